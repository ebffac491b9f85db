"""The client's live stream over the websocket /v1/stream (`Stream`, made by `Client.stream`), and
a file streamed through it (`stream_file`, behind `enhancer stream`).

A `Stream` holds the input it has sent whose output has not come back yet (and `resume_overlap_s`
before it) and runs one connection at a time:

* connect, send the start message; on `ready`, send the held input from where this connection
  starts, then whatever `send` adds, then `{"type": "end"}` once `end` was called;
* the enhanced audio comes back sample-aligned with what this connection was sent: the output of
  the overlap sent again is dropped, the rest is delivered in order (`async for`);
* close 1000 after the end: done (the output has exactly as many samples as the input);
* close 1013 (over capacity): wait the error's `retry_after_s` (at most `max_wait_s`), connect again;
* close 1012 (the service restarts): the stream is opened "resumable", so the service sends the
  output of all it read up to its last whole hop and then the stream's state; reconnect at once
  and hand that state back: the new connection continues the stream exactly where it stopped (the
  output equals an uninterrupted run's), from the first input sample the state has not seen;
* a restart without a state (a service that could not take it, or a state the new replica cannot
  use: another model), 1001, or a lost connection: reconnect with a backoff (0.25 s doubling, at
  most `max_wait_s`) and resume at the first sample whose output is missing, `resume_overlap_s`
  earlier so that the new stream's model has warmed up by then;
* any other close: a `ClientError` with the service's kind and message, raised where the stream is
  read (`async for`, `finish`, `drain`) and when the `async with` block ends. So is a service that
  cannot be reached at the first connection, and `max_retries` tries in a row without output.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
from pathlib import Path

import numpy as np

from .audio_io import AudioReader, AudioWriter, check_file, output_format_for_path
from .errors import AudioError, ClientError
from .signal import check_audio

RESUME = {1001, 1006, 1012}  # going away, connection lost, restarting: resume where the output stopped
MESSAGE_S = 0.5  # held input is resent in messages of at most this much audio (and the service's byte limit)
_END = object()


class Stream:
    """One live stream (see the module docstring). Use it as `async with client.stream(...) as s`."""

    def __init__(self, url: str, headers: dict, start: dict, *, on_message=None, resume_overlap_s: float = 1.0,
                 max_retries: int = 10, max_wait_s: float = 30.0, open_timeout_s: float = 10.0):
        self.url, self.headers, self.start = url, headers, start | {"resumable": True}
        self.sample_rate, self.channels = int(start["sample_rate"]), int(start["channels"])
        self.on_message, self.max_retries, self.max_wait_s = on_message, max_retries, max_wait_s
        self.overlap = max(0, int(resume_overlap_s * self.sample_rate))
        self.open_timeout_s = open_timeout_s
        self.ready: dict | None = None  # the service's last ready message
        self.sessions = 0  # connections that got as far as ready
        self.samples_in = 0  # samples given to `send`
        self.samples_out = 0  # enhanced samples delivered
        self._resume = Resumption(overlap=self.overlap)
        self._held: list[np.ndarray] = []  # input from sample `_held0` on, (n, channels) float32 each
        self._held0 = 0
        self._ended = False
        self._more = asyncio.Event()  # new input (or the end) for the sender
        self._progress = asyncio.Event()  # output delivered (for `drain`)
        self._out: asyncio.Queue = asyncio.Queue()
        self._error: BaseException | None = None
        self._first: asyncio.Future | None = None
        self._runner: asyncio.Task | None = None

    @property
    def resumed(self) -> int:
        """Connections that continued the stream from its state."""
        return self._resume.resumed

    # ------------------------------------------------------------------ the caller's side
    async def __aenter__(self) -> Stream:
        self._first = asyncio.get_running_loop().create_future()
        self._runner = asyncio.create_task(self._run())
        await asyncio.shield(self._first)  # the first ready, or the error that stopped the stream
        self._raise()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            await self.close()
            return
        if not self._ended:
            await self.end()
        await asyncio.shield(self._runner)
        if self._error is not None:
            raise self._error

    async def send(self, pcm) -> None:
        """Queue input: (n,) or (n, channels), float or integer PCM (int16 is scaled to [-1, 1)).
        It goes out at once while connected, else when the stream is back; it is never lost."""
        self._raise()
        if self._ended:
            raise RuntimeError("send after end: the stream's input is over")
        a = np.asarray(pcm)
        if a.size == 0 and a.ndim in (1, 2):
            return
        a = check_audio(a, "pcm")
        a = a[:, None] if a.ndim == 1 else a
        if a.shape[1] != self.channels:
            raise AudioError(f"pcm has {a.shape[1]} channel(s), the stream was opened with {self.channels}")
        self._held.append(np.ascontiguousarray(a, "<f4"))
        self.samples_in += len(a)
        self._more.set()

    async def end(self) -> None:
        """No more input: the service sends the rest of the output, then the stream ends."""
        self._ended = True
        self._more.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> np.ndarray:
        item = await self._out.get()
        if item is _END:
            self._out.put_nowait(_END)  # every later read ends too
            self._raise()
            raise StopAsyncIteration
        return item

    async def finish(self) -> np.ndarray:
        """`end`, then the output not read yet, concatenated (mono: (n,))."""
        await self.end()
        parts = [y async for y in self]
        empty = np.zeros((0,) if self.channels == 1 else (0, self.channels), np.float32)
        return np.concatenate(parts) if parts else empty

    async def drain(self, seconds: float) -> None:
        """Wait until at most `seconds` of the input sent has no output yet (a sender's pace when
        the input is there already: a file)."""
        while self.samples_in - self.samples_out > seconds * self.sample_rate:
            self._raise()
            if self._runner.done():
                return
            self._progress.clear()
            await self._progress.wait()
        self._raise()

    async def close(self) -> None:
        """Stop now, without the rest of the output."""
        if self._runner is not None and not self._runner.done():
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
        self._out.put_nowait(_END)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    # ------------------------------------------------------------------ connections
    async def _run(self) -> None:
        tries, reached = 0, False
        try:
            while True:
                code, error, got = await self._session()
                if code == 1000:
                    if self.samples_out != self.samples_in:
                        raise ClientError("protocol", f"the service returned {self.samples_out} samples for "
                                          f"{self.samples_in}")
                    break
                if isinstance(error, ClientError):  # refused at the handshake (HTTP status)
                    raise error
                if code is None and not reached:
                    raise ClientError("unreachable", f"cannot reach the service at {self.url}: {error.get('message')}; "
                                      "is it running?")
                reached = True
                if error.get("kind") == "invalid_state" and self._resume.state is not None:
                    self._resume.state = None  # a replica that cannot read it: resume with the overlap instead
                    code = 1012
                if code not in RESUME | {1013, None}:
                    raise ClientError.from_body(code, error) if error.get("kind") else ClientError(
                        "protocol", f"the stream closed with {code} {error.get('reason', '')}".rstrip(), code)
                tries = 0 if got else tries + 1
                if tries > self.max_retries:
                    last = ClientError.from_body(code, error) if error.get("kind") else None
                    raise ClientError(last.kind if last else "unreachable", f"gave up after {self.max_retries} "
                                      f"tries without output (last: {code}, {error.get('message', '')})", code)
                wait = error.get("retry_after_s", 5.0) if code == 1013 else 0.25 * 2 ** max(tries - 1, 0)
                if code == 1012 and self._resume.state is not None and tries <= 1:
                    wait = 0.0  # the state is in hand: the next replica continues at once
                await asyncio.sleep(min(float(wait), self.max_wait_s))
        except ClientError as e:
            self._error = e
        except Exception as e:  # whatever the transport raised: said as the client's error
            self._error = ClientError("protocol", f"the stream failed: {type(e).__name__}: {e}")
        finally:
            if self._first is not None and not self._first.done():
                self._first.set_result(None)
            self._out.put_nowait(_END)
            self._progress.set()

    async def _session(self):
        """One connection: (close code or None, last error message or the reason it could not
        connect, output samples delivered). It continues from the state in hand, or else from the
        first input sample whose output is missing (less the overlap)."""
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed, InvalidStatus, InvalidURI, WebSocketException

        try:
            ws = await connect(self.url, additional_headers=self.headers, open_timeout=self.open_timeout_s,
                               max_size=None, compression=None)
        except InvalidStatus as e:  # refused before the protocol: a proxy, or no such path
            status, body = e.response.status_code, _json(e.response.body)
            if status >= 500:  # a balancer with no replica up yet: as if nothing listened
                return None, {"message": f"HTTP {status}"}, 0
            return None, ClientError.from_body(status, body) if body else ClientError(
                "protocol", f"the service refused the websocket with HTTP {status}", status), 0
        except InvalidURI as e:
            return None, ClientError("invalid_url", str(e)), 0
        except (OSError, WebSocketException, TimeoutError) as e:
            return None, {"message": str(e) or type(e).__name__}, 0
        state = self._resume.state  # sent with the start message; given up once a ready answers it
        drop, got, error, sender = 0, 0, {}, None
        async with ws:
            try:
                with contextlib.suppress(ConnectionClosed):  # refused at once (1013): the error is queued
                    await self._resume.open(ws, self.start, state, self.ready)
                async for m in ws:  # ends on 1000 / 1001; raises ConnectionClosed on the others
                    if isinstance(m, bytes):
                        y = np.frombuffer(m, "<f4").reshape(-1, self.channels)
                        k = min(drop, len(y))
                        drop -= k
                        if len(y) > k:
                            got += len(y) - k
                            self._deliver(y[k:])
                        continue
                    msg = _json(m) or {}
                    if msg.get("type") == "ready" and sender is None:
                        self.ready, self.sessions = msg, self.sessions + 1
                        begin = self._resume.begin(msg, state, self.samples_out)
                        self._resume.state = None  # used (or refused): a state is of one moment of the stream
                        drop = self.samples_out - begin if not msg.get("resumed") else 0
                        sender = asyncio.create_task(self._send(ws, begin, int(msg.get("max_message_bytes", 1 << 20))))
                        if not self._first.done():
                            self._first.set_result(None)
                    elif msg.get("type") == "error":
                        error = msg
                    elif msg.get("type") == "state":
                        self._resume.keep(msg, self.samples_out, self._held0, self.samples_in)
                    if self.on_message is not None:
                        self.on_message(msg)
            except ConnectionClosed:
                pass
            finally:
                if sender is not None:
                    sender.cancel()
                    with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                        await sender
        code = ws.close_code
        if not error and code not in (1000, None):
            error = {"reason": ws.close_reason or ""}
        return code, error, got

    async def _send(self, ws, pos: int, max_bytes: int) -> None:
        """This connection's sender: the held input from `pos`, what comes after, then the end."""
        from websockets.exceptions import ConnectionClosed

        most = max(1, min(max_bytes // (4 * self.channels), int(MESSAGE_S * self.sample_rate)))
        with contextlib.suppress(ConnectionClosed):  # the receiver learns why
            while True:
                while pos < self.samples_in:
                    chunk = self._slice(pos, most)
                    await ws.send(chunk.tobytes())
                    pos += len(chunk)
                if self._ended:
                    await ws.send(json.dumps({"type": "end"}))
                    return
                self._more.clear()
                if pos >= self.samples_in and not self._ended:
                    await self._more.wait()

    def _slice(self, pos: int, most: int) -> np.ndarray:
        """Up to `most` held input samples from `pos`."""
        at = self._held0
        for a in self._held:
            if pos < at + len(a):
                return a[pos - at:pos - at + most]
            at += len(a)
        raise AssertionError(f"input sample {pos} is not held")

    def _deliver(self, y: np.ndarray) -> None:
        self.samples_out += len(y)
        keep = max(0, self.samples_out - self.overlap)  # what a resume sends again
        while self._held and self._held0 + len(self._held[0]) <= keep:
            self._held0 += len(self._held.pop(0))
        self._out.put_nowait(y[:, 0].copy() if self.channels == 1 else y.copy())
        self._progress.set()


class Resumption:
    """What a `Stream` keeps to continue after a restart: the service's last "state" message (the
    state decoded), until a connection uses it, and where the service's stream began (its counts
    start there)."""

    def __init__(self, overlap: int):
        self.overlap = overlap  # input samples sent again before the first missing output without a state
        self.state: dict | None = None
        self.origin = 0  # the input sample where the service's current stream began
        self.resumed = 0  # connections that continued the stream from a state

    async def open(self, ws, start: dict, state: dict | None, ready: dict | None) -> None:
        """The start message; with a state, "resume_bytes" and the state after it in messages of at
        most the last `ready`'s max_message_bytes."""
        if state is None:
            await ws.send(json.dumps(start))
            return
        blob = state["state"]
        await ws.send(json.dumps(start | {"resume_bytes": len(blob)}))
        most = int((ready or {}).get("max_message_bytes", 1 << 20))
        for i in range(0, len(blob), most):
            await ws.send(blob[i:i + most])

    def begin(self, ready: dict, state: dict | None, samples_out: int) -> int:
        """The first input sample a connection sends: where the state resumed, or `overlap` before
        the first output sample missing (`samples_out`, the output delivered)."""
        resumed = ready.get("resumed")
        if state is not None and isinstance(resumed, dict):
            at = self.origin + int(resumed.get("output_samples", -1))
            if at != samples_out:
                raise ClientError("protocol", f"the service resumed at output sample {at}, {samples_out} were delivered")
            self.resumed += 1
            return self.origin + int(resumed["input_samples"])
        self.origin = max(0, samples_out - self.overlap)
        return self.origin

    def keep(self, msg: dict, samples_out: int, held_from: int, samples_in: int) -> None:
        """A "state" message: kept for the next connection if it continues the output delivered
        (`samples_out`) from input that is held (`held_from`..`samples_in`)."""
        try:
            blob = base64.b64decode(msg.get("state", ""), validate=True)
            at_in, at_out = self.origin + int(msg["input_samples"]), self.origin + int(msg["output_samples"])
        except (binascii.Error, KeyError, TypeError, ValueError):
            return  # not usable: the next connection resumes with the overlap
        if at_out == samples_out and held_from <= at_in <= samples_in:
            self.state = {"state": blob, "input_samples": at_in, "output_samples": at_out}


def _json(data):
    try:
        return json.loads(data)
    except (TypeError, ValueError):
        return None


async def stream_file(client, src: Path, dst: Path, *, speed: float, chunk_ms: int, format: str | None,
                      on_message, options: dict) -> dict:
    """`Client.stream_file`: the file checked first (the command line's errors), streamed at
    `speed` times real time (0: as fast as the service takes it, at most 10 s ahead of the output),
    the output written as it comes to `dst` (`dst.part` until it is complete)."""
    info = check_file(src)
    fmt, subtype = output_format_for_path(dst, info, src, format)
    rate, channels = info.sample_rate, info.channels
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".part")
    writer = AudioWriter(tmp, fmt, subtype, rate, channels, info.endian if fmt == info.format else "FILE")
    frames = 0
    try:
        with AudioReader(src) as reader:
            async with client.stream(rate, channels, on_message=on_message, **options) as s:

                async def produce():
                    loop = asyncio.get_running_loop()
                    t0, sent = loop.time(), 0
                    step = max(1, rate * chunk_ms // 1000) if speed > 0 else rate
                    try:
                        for block in reader.blocks(step):
                            await s.send(block)
                            sent += len(block)
                            if speed > 0:
                                await asyncio.sleep(max(0.0, t0 + sent / rate / speed - loop.time()))
                            else:
                                await s.drain(10.0)
                        await s.end()
                    except Exception:
                        await s.close()  # the reading below ends; awaiting this task raises the error
                        raise

                producer = asyncio.create_task(produce())
                try:
                    async for y in s:
                        writer.write(y.reshape(-1, channels))
                        frames += len(y)
                finally:
                    if not producer.done():
                        producer.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await producer
        writer.close()
    except BaseException:
        writer.abort()
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(dst)
    return {"path": str(dst), "sample_rate": rate, "channels": channels, "frames": frames, "sessions": s.sessions}
