"""The HAProxy agent-check port (`agent_port`; deploy/haproxy.cfg, deploy/README.md).

For each TCP connection the server writes one ASCII line and closes it, reading nothing:

* `<P>% ready up` when ready, `P = floor(100 * free / capacity)` with `free` and `capacity` as
  /readyz reports them (`capacity.free`, `capacity.streams`): `0% ready up` when full;
* `drain` from SIGTERM on (the drain, `server.drain`);
* `down` while not ready (a worker stopped).

HAProxy turns the percentage into the replica's weight, so `balance leastconn` sends a new stream
where the most capacity is free and none to a full or draining replica.
"""
from __future__ import annotations

import asyncio
import logging
import socket

log = logging.getLogger("tim_enhancer.server")


def status_line(app) -> bytes:
    """The agent's answer for `app` now."""
    state = app.state
    if state.draining:
        return b"drain\n"
    scheduler = state.scheduler
    cap = scheduler.capacity
    if not scheduler.ready or cap is None:
        return b"down\n"
    free = scheduler.admission.free
    return f"{100 * free // cap.streams if cap.streams > 0 else 0}% ready up\n".encode()


class Agent:
    """The agent's TCP server on the event loop: on `sock` (bound already), or on (`host`, `port`)."""

    def __init__(self, app, sock: socket.socket | None = None, host: str = "127.0.0.1", port: int = 0):
        self.app, self.sock, self.host, self.port = app, sock, host, port
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        if self.sock is not None:
            self.server = await asyncio.start_server(self._answer, sock=self.sock)
        else:
            self.server = await asyncio.start_server(self._answer, self.host, self.port, reuse_address=True)
        self.port = self.server.sockets[0].getsockname()[1]
        log.info("HAProxy agent on port %d (free capacity as a weight, drain on SIGTERM)", self.port)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(status_line(self.app))
            await asyncio.wait_for(writer.drain(), 1.0)
        except (OSError, asyncio.TimeoutError, TimeoutError):
            pass  # the checker went away: nothing to tell it
        finally:
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            try:
                await asyncio.wait_for(self.server.wait_closed(), 1.0)
            except (asyncio.TimeoutError, TimeoutError):
                pass
            self.server = None
