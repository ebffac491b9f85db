"""uvicorn's HTTP and websocket protocols with a stall guard: a connection whose client has read
nothing for `stall_timeout_s` while output waits is dropped.

A client that stops reading fills the socket buffers; uvicorn then pauses writing, and every send
(including the close frame and keepalive pings) waits for the buffer to drain, which never happens
while the client keeps the TCP connection open. Without a guard such a client holds its stream, its
connection and its buffers forever. The guard starts a timer when the transport pauses writing,
cancels it when writing resumes, and aborts the transport when it fires: the handler then sees an
ordinary disconnect and frees everything.
"""
from __future__ import annotations

import logging

log = logging.getLogger("tim_enhancer.server")


class StallGuard:
    """Mixin for uvicorn protocol classes (they all implement pause_writing/resume_writing)."""

    stall_timeout_s: float = 30.0
    on_stall = None  # called with no argument when a connection is dropped
    _stall_timer = None

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.stall_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        self._cancel_stall_timer()
        super().resume_writing()

    def connection_lost(self, exc) -> None:
        self._cancel_stall_timer()
        super().connection_lost(exc)

    def _cancel_stall_timer(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _stalled(self) -> None:
        self._stall_timer = None
        peer = getattr(self, "client", None)
        log.warning("client %s read nothing for %g s while output was waiting: dropping the connection",
                    "%s:%s" % peer if peer else "?", self.stall_timeout_s)
        if self.on_stall is not None:
            self.on_stall()
        self.transport.abort()


def guarded(base: type, stall_timeout_s: float, on_stall=None) -> type:
    """`base` (a uvicorn protocol class) with the stall guard."""
    return type(f"StallGuarded{base.__name__}", (StallGuard, base),
                {"stall_timeout_s": float(stall_timeout_s), "on_stall": staticmethod(on_stall) if on_stall else None})


def protocol_classes(stall_timeout_s: float, on_stall=None) -> dict:
    """uvicorn.Config keyword arguments `http` and `ws`: the default implementations, guarded."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol

    return {"http": guarded(AutoHTTPProtocol, stall_timeout_s, on_stall),
            "ws": guarded(AutoWebSocketsProtocol, stall_timeout_s, on_stall)}
