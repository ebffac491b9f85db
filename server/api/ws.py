"""Websocket /v1/stream: live audio in, enhanced audio out (protocol in README.md, "Streaming").

    client -> {"sample_rate": 48000, "encoding": "pcm_s16le", "channels": 1,
               "atten_lim_db": null, "metadata": false, "band": "full",
               "level": "model"}                                     optional start message
                                          (band "speech": nothing above 8 kHz; level "input": the voice
                                           at the input's speech level)
    server -> {"type": "ready", ...}                                 stream parameters and delay
    client -> binary audio, any number of whole frames per message
    server -> binary enhanced audio (same encoding, rate, channels), sample-aligned with the input
    server -> {"type": "metadata", "frames": [...]}                  only with "metadata": true
    client -> {"type": "end"}
    server -> the tail, then {"type": "end", "samples": n}, then close 1000

A restart (drain) sends the tail of what was read and closes 1012. A stream that said
"resumable": true gets instead the output of every whole hop read, then
{"type": "state", "state": base64, "input_samples", "output_samples"}, then close 1012: a new
connection that sends "resume_bytes": the state's size in its start message, then the state in
binary messages, then the input from sample `input_samples` on, continues the stream exactly (its
output goes on at sample `output_samples`; "ready" says "resumed"). A state of another model is
not used: "ready" then says "resumed": null and why, and the stream starts afresh.

Errors: {"type": "error", "kind", "message", "code"}, then close with `code` (1003 unsupported
data, 1007 invalid payload, 1008 policy/auth/limits, 1009 too big, 1011 internal, 1013 over capacity:
the error then also carries "capacity", "active_streams" and "retry_after_s").

A live stream that falls behind gets {"type": "late", "lateness_ms", "budget_ms", "max_lateness_ms"},
then {"type": "on_time", "lateness_ms"} once it has caught up; if its backlog was skipped,
{"type": "gap", "start_sample", "samples", "skipped_ms", "lateness_ms"} names the output samples
(at the stream's rate) that are not its enhanced input.
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import time

import numpy as np
from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from enhancer import handoff
from enhancer.cursor import StepFrame, delay_at, latency_at
from enhancer.errors import StateError
from server.api.aio import timeout as _timeout
from server.api.pcm import decode_pcm, encode_pcm
from server.errors import ErrorKind, ServiceError, from_core, too_large
from server.messages import Source, StartMessage, event_message
from server.scheduling.jobs import Delivery, Job

log = logging.getLogger("tim_enhancer.server")

router = APIRouter()


class _Closed(Exception):
    """The client went away."""


class _Drain(Exception):
    """The server is shutting down: stop reading, send the tail."""


@router.websocket("/v1/stream")
async def stream(ws: WebSocket) -> None:
    await ws.accept()
    session = StreamSession(ws)
    ws.app.state.sessions.add(session)
    keys, key = ws.app.state.keys, None
    try:
        if ws.app.state.draining:
            raise _Drain()
        key = keys.open_stream(ws.scope)  # the API key's own limit of live streams (1013 key_limit)
        admission = ws.app.state.scheduler.admission
        if admission.live_full:  # refused at the handshake: no need to wait for the start message
            raise admission.over_capacity(Source.STREAM)
        await session.run()
    except ServiceError as e:
        await session.fail(e)
    except _Drain:
        await session.fail(ServiceError(ErrorKind.SHUTTING_DOWN, "the server is shutting down; reconnect"))
    except _Closed:
        pass
    except Exception:  # a bug: report it as internal and keep serving
        log.exception("websocket stream failed")
        await session.fail(ServiceError(ErrorKind.INTERNAL, "internal error; the stream was closed"))
    finally:
        session.cleanup()
        keys.close_stream(key)
        ws.app.state.sessions.discard(session)
        session.finished.set()


class StreamSession:
    """The websocket handler of one live job: the socket, the message-rate limit, parsing the
    client's messages and writing the job's deliveries, and the server's drain. What the job has
    sent and what is acknowledged is the `Job`'s (`server.scheduling.jobs`), not kept here."""

    def __init__(self, ws: WebSocket):
        self.ws = ws
        app = ws.app
        self.settings, self.scheduler, self.metrics = app.state.settings, app.state.scheduler, app.state.metrics
        self.job: Job | None = None
        self.closing = False
        self.writer: asyncio.Task | None = None
        self.samples_in = 0
        self.samples_out = 0
        self.draining = False
        self.stop_error: ServiceError | None = None  # drain(error): close with it instead of 1012
        self.finished = asyncio.Event()
        self.key_seconds = app.state.keys.audio_counter(ws.scope, Source.STREAM)
        self._deadline = None  # the idle timer of the receive in progress
        # message-rate limit: a token bucket refilled at max_messages_per_s, holding one second's worth
        self._tokens = self._burst = max(float(self.settings.max_messages_per_s), 1.0)
        self._refilled = time.monotonic()

    # ------------------------------------------------------------------ reading
    async def run(self) -> None:
        s = self.settings
        first = await self._receive()
        if "text" in first:
            start = StartMessage.from_text(first["text"])
            first = None
        else:
            start = StartMessage()
        self.encoding, self.resumable = start.encoding, start.resumable
        state, resumed = await read_state(self, start)
        if isinstance(resumed, dict):  # the counts go on from the state's
            self.samples_in, self.samples_out = resumed["input_samples"], resumed["output_samples"]
        self.job = self.scheduler.open(start.sample_rate, start.channels, start.atten_lim_db, start.metadata,
                                       Source.STREAM, start.band, start.level, state)
        rate = self.job.sample_rate
        self.max_samples = int(s.max_stream_s * rate)
        self.max_buffered = max(int(s.max_buffered_s * rate), 1)
        await self._send_json(self._ready_message(start, resumed))
        self.writer = asyncio.create_task(self._write())
        message, suspend = first, False
        try:
            while True:
                if message is None:
                    message = await self._receive()
                if "bytes" in message and message["bytes"] is not None:
                    await self._audio(message["bytes"])
                elif self._control(message.get("text")):
                    break
                message = None
        except _Drain:  # shutting down: the tail of what was received (or the state), then close 1012
            suspend = self.resumable
        self.job.end(suspend)
        await self.writer

    @property
    def buffered(self) -> int:
        """Samples pushed to the job and not yet acknowledged."""
        return self.job.buffered if self.job is not None else 0

    def drain(self, error: ServiceError | None = None) -> None:
        """Stop reading at the next message boundary (wakes a receive that is waiting); then send the
        tail and 1012, or with `error` (its API key was removed) that error and its close code."""
        self.draining, self.stop_error = True, error or self.stop_error
        if self._deadline is not None:
            self._deadline.reschedule(asyncio.get_running_loop().time())

    async def _receive(self) -> dict:
        if self.draining:
            raise self.stop_error or _Drain()
        try:
            async with _timeout(self.settings.idle_timeout_s) as deadline:  # a timer, not a task, per message
                self._deadline = deadline
                message = await self.ws.receive()
        except (asyncio.TimeoutError, TimeoutError):
            if self.draining:
                raise (self.stop_error or _Drain()) from None
            raise ServiceError(ErrorKind.IDLE_TIMEOUT, f"no message for {self.settings.idle_timeout_s:g} s; "
                               "closing the stream") from None
        except (WebSocketDisconnect, RuntimeError):
            raise _Closed() from None
        finally:
            self._deadline = None
        if message["type"] == "websocket.disconnect":
            raise _Closed()
        data = message.get("bytes")
        if data is None:
            data = (message.get("text") or "").encode()
        if len(data) > self.settings.max_message_bytes:
            raise too_large(len(data), self.settings.max_message_bytes)
        self._count_message()
        return message

    def _count_message(self) -> None:
        """Take one token from the message-rate bucket, or ServiceError (rate_limited)."""
        rate = self.settings.max_messages_per_s
        if math.isinf(rate):
            return
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._refilled) * rate)
        self._refilled = now
        if self._tokens < 1.0:
            raise ServiceError(ErrorKind.RATE_LIMITED, f"more than {rate:g} messages per second; send fewer, larger "
                               "messages (20 ms of audio or more each)")
        self._tokens -= 1.0

    def _ready_message(self, start: StartMessage, resumed) -> dict:
        cfg, job = self.scheduler.enhancer.config, self.job
        extra = {} if start.resume_bytes is None else \
            {"resumed": resumed} if isinstance(resumed, dict) else {"resumed": None, "resume_refused": resumed}
        return extra | {
            "type": "ready", "sample_rate": job.sample_rate, "encoding": self.encoding, "channels": job.channels,
            "atten_lim_db": start.atten_lim_db, "metadata": start.metadata, "band": start.band,
            "level": start.level,
            "latency_ms": latency_at(cfg, job.sample_rate), "hop_ms": 1000.0 * cfg.stft.hop / cfg.stft.sample_rate,
            "delay_samples": delay_at(cfg, job.sample_rate), "max_message_bytes": self.settings.max_message_bytes,
            "resumable": start.resumable,
        }

    async def _audio(self, data: bytes) -> None:
        job = self.job
        x = decode_pcm(data, self.encoding, job.channels)
        n = x.shape[0]
        if n == 0:
            return
        self.samples_in += n
        if self.samples_in > self.max_samples:
            raise ServiceError(ErrorKind.TOO_LONG, f"the stream is over the limit of {self.settings.max_stream_s:g} s of audio")
        while job.buffered >= self.max_buffered:  # inference is behind: stop reading until it catches up
            job.acknowledged.clear()
            await self._wait_acknowledged()
        job.push(x)
        self.metrics.stream_seconds.inc(n / job.sample_rate)
        self.key_seconds(n / job.sample_rate)

    async def _wait_acknowledged(self) -> None:
        waiter = asyncio.ensure_future(self.job.acknowledged.wait())
        done, _ = await asyncio.wait({waiter, self.writer}, return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            waiter.cancel()
            raise _Closed()  # the writer ended (error sent, or the client is gone)

    def _control(self, text: str | None) -> bool:
        """Handle a text message during the stream; True on the end message."""
        msg = _parse_json(text or "")
        if isinstance(msg, dict) and msg.get("type") == "end":
            return True
        if isinstance(msg, dict) and msg.get("type", "start") == "start":
            raise ServiceError(ErrorKind.BAD_REQUEST, "the start message must be the first message of the stream")
        raise ServiceError(ErrorKind.UNSUPPORTED_MEDIA, "text messages carry JSON control messages ({\"type\": \"end\"}) "
                           "only; send audio as binary messages")

    # ------------------------------------------------------------------ writing
    async def _write(self) -> None:
        """Forward deliveries to the client until the final one (or an error)."""
        while True:
            d: Delivery = await self.job.next()
            if d.error is not None:
                await self.fail(d.error)
                return
            if d.audio.shape[0] and not np.isfinite(d.audio).all():  # output guard: never send NaN/Inf
                await self.fail(ServiceError(ErrorKind.INTERNAL, "the enhancement produced invalid samples; the stream "
                                             "was closed"))
                return
            if d.audio.shape[0]:
                self.samples_out += d.audio.shape[0]
                await self._send_bytes(encode_pcm(d.audio, self.encoding))
            if d.frames:
                await self._send_json(self._metadata_message(d.frames))
            for event in d.events:  # "late", "on_time", "gap" (README: Capacity, admission and lateness)
                await self._send_json(event_message(event))
            if d.final:
                out = self.samples_out
                if d.state is not None:
                    await self._send_json({"type": "state", "state": base64.b64encode(d.state).decode("ascii"),
                                           "input_samples": self.samples_in, "output_samples": out})
                if d.state is not None or self.draining:
                    resend = (f"reconnect with this state and resend the audio from sample {self.samples_in}, or "
                              f"without it from sample {out}" if d.state is not None else
                              f"reconnect and resend the audio from sample {out}")
                    await self._send_json({"type": "end", "samples": out, "reason": "shutdown",
                                           "message": f"the server is restarting: {resend}"})
                    await self._close(1012, "server shutting down")
                else:
                    await self._send_json({"type": "end", "samples": self.samples_out})
                    await self._close(1000)
                return

    @staticmethod
    def _metadata_message(frames: list[StepFrame]) -> dict:
        out = []
        for frame in frames:
            if frame.time_s is None:
                continue  # frames that only fill the model's delay
            f = {"frame": int(frame.index), "time_s": round(frame.time_s, 4),
                 "activity": np.round(frame.activity.astype(float), 4).tolist()}
            if frame.competition is not None:  # (channels, tim_layers, mechanisms)
                f["competition"] = np.round(frame.competition.astype(float), 4).tolist()
            out.append(f)
        return {"type": "metadata", "frames": out}

    # ------------------------------------------------------------------ sending and closing
    async def _send_bytes(self, data: bytes) -> None:
        try:
            await self.ws.send_bytes(data)
        except Exception:  # whatever the transport raises: the client is gone
            raise _Closed() from None

    async def _send_json(self, msg: dict) -> None:
        try:
            await self.ws.send_text(json.dumps(msg, separators=(",", ":")))
        except Exception:  # whatever the transport raises: the client is gone
            raise _Closed() from None

    async def fail(self, err: ServiceError) -> None:
        """Report `err` to the client and close with its code (once)."""
        if self.closing:
            return
        self.metrics.errors.labels(kind=err.kind).inc()
        self.ws.app.state.keys.note_error(self.ws.scope, err)
        if self.writer is not None and self.writer is not asyncio.current_task():
            self.writer.cancel()  # one sender at a time: let the writer stop before the error goes out
            await asyncio.gather(self.writer, return_exceptions=True)
        try:
            await self._send_json(err.ws_message())
        except _Closed:
            pass
        await self._close(err.close_code, err.message)

    async def _close(self, code: int, reason: str = "") -> None:
        if self.closing:
            return
        self.closing = True
        if self.ws.application_state == WebSocketState.CONNECTED:
            try:
                await self.ws.close(code, close_reason(reason))
            except Exception:  # the connection is gone already: nothing left to close
                pass

    def cleanup(self) -> None:
        if self.writer is not None and not self.writer.done():
            self.writer.cancel()
        if self.job is not None:
            self.job.close()


async def read_state(session: StreamSession, start: StartMessage) -> tuple[bytes | None, dict | str | None]:
    """The state that follows a start message with "resume_bytes", read from its binary messages,
    and what "ready" says of it: (state, {"input_samples", "output_samples"}) to continue; (None,
    why) for a state of another model (the stream starts afresh); (None, None) without one."""
    n, limit = start.resume_bytes, session.settings.max_state_bytes
    if n is None:
        return None, None
    if not 0 < n <= limit:
        raise ServiceError(ErrorKind.INVALID_STATE, f"resume_bytes must be in 1..{limit} (max_state_bytes), got {n}")
    parts, got = [], 0
    while got < n:
        message = await session._receive()
        data = message.get("bytes")
        if data is None or got + len(data) > n:
            raise ServiceError(ErrorKind.INVALID_STATE, f"the {n} bytes of state must follow the start message "
                               f"in binary messages, before the audio (got {got} bytes, then "
                               f"{'text' if data is None else f'{len(data)} more'})")
        parts.append(data)
        got += len(data)
    state = b"".join(parts)
    try:
        meta = handoff.peek(state)
    except StateError as e:
        raise from_core(e) from None
    if meta.get("format") != handoff.FORMAT:
        return None, "the state is of another version of the service; the stream starts afresh"
    if meta.get("model") != session.scheduler.enhancer.engine.identity:
        return None, "the state is of another model; the stream starts afresh"
    counts = {key: meta.get(key) for key in ("input_samples", "output_samples")}
    for key, v in counts.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ServiceError(ErrorKind.INVALID_STATE, f"the state's meta has no sample count {key} (got {v!r})")
    return state, counts


def close_reason(text: str, limit: int = 123) -> str:
    """`text` cut to the `limit` bytes of UTF-8 a close frame's reason may hold, never inside a
    character (a reason that is not valid UTF-8 breaks the close)."""
    return text.encode("utf-8")[:limit].decode("utf-8", "ignore")


def _parse_json(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None
