"""The graceful drain on SIGTERM / SIGINT (`server.serving.Server` runs it before uvicorn's shutdown).

From the signal on, the server keeps listening but takes nothing new: `/readyz` answers 503
(`{"ready": false, "draining": true}`), the HAProxy agent answers `drain`, a new websocket stream
gets the `shutting_down` error and 1012, a new upload 503 `shutting_down`; `/healthz` stays 200
until the process exits. What is in flight goes on:

* uploads (POST /v1/enhance) in flight complete; one still running when the drain ends gets
  `drain_timeout_s` more from uvicorn's graceful shutdown;
* live streams run on as usual (one that ends gets its tail and 1000) for up to `drain_timeout_s`
  from the signal; those still open then stop being read, get the enhanced tail of all the audio
  the server read (a `resumable` one: the output of its whole hops, then its state),
  `{"type": "end", "samples": n, "reason": "shutdown", "message": ...}` (reconnect and resend from
  sample n, or with the state from where it stops) and close 1012; the drain then waits for their
  closing handshakes (`flush`), so that a client still sending gets all of it.

The drain ends as soon as no stream and no upload is left; then the listening sockets close and
uvicorn shuts down (the workers stop, the process ends by the signal it received).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger("tim_enhancer.server")

TAIL_TIMEOUT_S = 5.0  # streams closed at the end of the drain: longest wait for their tails
POLL_S = 0.05


def begin(app) -> None:
    """Start draining now: /readyz 503, agent `drain`, new streams and uploads refused. Safe to call
    from a signal handler (no lock taken, nothing logged) and more than once."""
    state = app.state
    if not state.draining:
        state.draining = True
        state.drain_started = time.monotonic()
        state.metrics.draining.set(1)


async def flush(connections, timeout_s: float = TAIL_TIMEOUT_S) -> None:
    """Wait until the websocket connections that sent their close frame have their closing
    handshake done and their last bytes written (at most `timeout_s`). uvicorn's shutdown closes
    such a connection at once: a client still sending audio then gets a reset, and a reset throws
    away what it had not read yet (a stream's last messages: a resumable stream's state is
    megabytes)."""
    deadline = time.monotonic() + timeout_s

    def closing(c) -> bool:
        t = getattr(c, "transport", None)
        return getattr(c, "close_sent", False) or (t is not None and t.get_write_buffer_size() > 0)

    while any(closing(c) for c in list(connections)) and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S / 5)


def in_flight(app) -> tuple[int, int]:
    """(open streams, uploads in flight)."""
    return sum(not s.finished.is_set() for s in app.state.sessions), app.state.uploads


async def run(app, timeout_s: float, force: Callable[[], bool] = lambda: False) -> None:
    """Drain `app`: wait until no stream and no upload is left, at most `timeout_s` from `begin`; then
    send the streams still open their tails and 1012 (at most TAIL_TIMEOUT_S more). `force()` true (a
    second Ctrl+C) cuts the wait short."""
    begin(app)
    started = app.state.drain_started
    streams, uploads = in_flight(app)
    log.info("draining: /readyz answers 503, new streams and uploads are refused; %d stream(s) run on for up to "
             "%g s, %d upload(s) in flight finish", streams, timeout_s, uploads)
    while any(in_flight(app)) and time.monotonic() < started + timeout_s and not force():
        await asyncio.sleep(POLL_S)
    left = [s for s in app.state.sessions if not s.finished.is_set()]
    if left:
        log.info("drain: %d stream(s) still open after %.1f s: sending their tails, then 1012", len(left),
                 time.monotonic() - started)
        for s in left:
            s.drain()
        try:
            await asyncio.wait_for(asyncio.gather(*(s.finished.wait() for s in left)), TAIL_TIMEOUT_S)
        except (asyncio.TimeoutError, TimeoutError):
            n = sum(not s.finished.is_set() for s in left)
            log.warning("%d stream(s) did not finish within %g s; closing them", n, TAIL_TIMEOUT_S)
    if app.state.uploads:
        log.info("drain: %d upload(s) still in flight after %.1f s; they get up to %g s more", app.state.uploads,
                 time.monotonic() - started, timeout_s)
    else:
        log.info("drained in %.1f s", time.monotonic() - started)
