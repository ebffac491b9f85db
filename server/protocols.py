"""uvicorn's HTTP and websocket protocols with a stall guard: a connection whose client has read
nothing for `stall_timeout_s` while output waits is dropped; and, for websockets, the documented
answer to an oversized message from the protocol layer too (`OversizeAnswer`).

A client that stops reading fills the socket buffers; uvicorn then pauses writing, and every send
(including the close frame and keepalive pings) waits for the buffer to drain, which never happens
while the client keeps the TCP connection open. Without a guard such a client holds its stream, its
connection and its buffers forever. The guard starts a timer when the transport pauses writing,
cancels it when writing resumes, and aborts the transport when it fires: the handler then sees an
ordinary disconnect and frees everything.
"""
from __future__ import annotations

import json
import logging

from server.errors import too_large

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
                    f"{peer[0]}:{peer[1]}" if peer else "?", self.stall_timeout_s)
        if self.on_stall is not None:
            self.on_stall()
        self.transport.abort()


class OversizeAnswer:
    """Mixin for uvicorn's websockets (sans-I/O) protocol. Its frame cap (`ws_max_size`, a little
    above `max_message_bytes`) refuses a bigger frame from its header, before the payload is read,
    so a connection never buffers more than one message of about the limit. The library's own
    answer is a bare close 1009 whose reason names the cap; this sends the service's documented
    answer instead: the JSON error message, then close 1009 with the same text. The rest of the
    message is read and dropped (nothing buffered) until the client closes or `close_timeout`
    passes: closing a socket with unread data would reset the connection, and a client still
    sending would lose the answer."""

    max_message_bytes: int = 1 << 20
    on_too_large = None  # called with no argument for each message refused here
    _oversize_answered = False

    def handle_parser_exception(self) -> None:
        from websockets.exceptions import PayloadTooBig
        from websockets.frames import Close, Frame, Opcode

        if self._oversize_answered:  # more of the refused message: already dropped by the parser
            return
        exc = self.conn.parser_exc
        if not isinstance(exc, PayloadTooBig) or self.close_sent or getattr(exc, "size", None) is None:
            return super().handle_parser_exception()
        self._oversize_answered = True
        err = too_large(exc.size + (exc.current_size or 0), self.max_message_bytes, at_least=True)
        self.conn.data_to_send()  # drop the library's close frame: ours carries the documented reason
        reason = err.message[:120]
        text = json.dumps(err.ws_message(), separators=(",", ":")).encode()
        self.transport.write(Frame(Opcode.TEXT, text).serialize(mask=False)
                             + Frame(Opcode.CLOSE, Close(err.close_code, reason).serialize()).serialize(mask=False))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.close_sent = True
        self.queue.put_nowait({"type": "websocket.disconnect", "code": err.close_code, "reason": reason})
        if self.close_timer is None:
            self.close_timer = self.loop.call_later(self.close_timeout, self.transport.abort)
        if self.on_too_large is not None:
            self.on_too_large()


def guarded(base: type, stall_timeout_s: float, on_stall=None, max_message_bytes: int | None = None,
            on_too_large=None) -> type:
    """`base` (a uvicorn protocol class) with the stall guard, and for the websockets sans-I/O
    protocol with `max_message_bytes` the documented answer to oversized messages."""
    bases: tuple = (StallGuard, base)
    attrs = {"stall_timeout_s": float(stall_timeout_s), "on_stall": staticmethod(on_stall) if on_stall else None}
    if max_message_bytes is not None and hasattr(base, "handle_parser_exception"):
        bases = (StallGuard, OversizeAnswer, base)
        attrs |= {"max_message_bytes": int(max_message_bytes),
                  "on_too_large": staticmethod(on_too_large) if on_too_large else None}
    return type(f"StallGuarded{base.__name__}", bases, attrs)


def protocol_classes(stall_timeout_s: float, on_stall=None, max_message_bytes: int | None = None,
                     on_too_large=None) -> dict:
    """uvicorn.Config keyword arguments `http` and `ws`: the default implementations, guarded."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol

    return {"http": guarded(AutoHTTPProtocol, stall_timeout_s, on_stall),
            "ws": guarded(AutoWebSocketsProtocol, stall_timeout_s, on_stall, max_message_bytes, on_too_large)}
