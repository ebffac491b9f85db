"""An example client of the websocket `/v1/stream` that survives a full server and a restart.

    python -m enhancer.client noisy.wav -o clean.wav --url ws://127.0.0.1:8000/v1/stream

    y, rate = asyncio.run(enhance_file("noisy.wav"))          # or enhance_file(array, sample_rate=16000)

It sends the audio in 20 ms chunks at the pace of a microphone (`speed` times real time) and
collects the enhanced audio, which is sample-aligned with the input. When the server is full it
closes with 1013 and an error carrying `retry_after_s`: the client waits that long and tries
again. When the server restarts it sends the enhanced tail of all it read, `{"type": "end",
"samples": n, "reason": "shutdown"}` and closes with 1012: the client reconnects and resends the
input from sample n, so the output always has the input's length. It resends `resume_overlap_s`
more than that and drops the output of the overlap, so that the new stream's model has warmed up
by sample n. Needs `websockets`, `numpy` and (for files) `soundfile`.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

DEFAULT_URL = "ws://127.0.0.1:8000/v1/stream"
RESUME = {1001, 1006, 1012}  # going away, connection lost, server restarting: resume where the output stopped


async def _session(url, x, rate, start, headers, speed, chunk_ms, on_message):
    """One connection: stream `x` (frames, channels) float32, then end. Returns (output, close code,
    last error message); close code None when the server could not be reached."""
    received, error = [], {}
    try:
        ws = await connect(url, additional_headers=headers, open_timeout=10)
    except (OSError, InvalidHandshake, TimeoutError) as e:
        return np.zeros((0, x.shape[1]), np.float32), None, {"message": str(e)}

    async def send():
        step, loop = max(1, rate * chunk_ms // 1000), asyncio.get_running_loop()
        t0 = loop.time()
        with contextlib.suppress(ConnectionClosed):  # the server closed first: the receiver knows why
            for i in range(0, len(x), step):
                await ws.send(x[i:i + step].tobytes())
                await asyncio.sleep(max(0.0, t0 + (i + step) / rate / speed - loop.time()))
            await ws.send(json.dumps({"type": "end"}))

    sender = None
    async with ws:
        try:
            with contextlib.suppress(ConnectionClosed):  # refused at once (1013): the error is queued
                await ws.send(json.dumps(start))
            async for m in ws:  # ends on close 1000; raises ConnectionClosed on the others
                if isinstance(m, bytes):
                    received.append(np.frombuffer(m, "<f4").reshape(-1, x.shape[1]))
                    continue
                msg = json.loads(m)
                if msg.get("type") == "ready" and sender is None:
                    sender = asyncio.create_task(send())
                elif msg.get("type") == "error":
                    error = msg
                if on_message is not None:
                    on_message(msg)  # ready, late, on_time, gap, metadata, end, error ...
        except ConnectionClosed:
            pass
        finally:
            if sender is not None:
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sender
    out = np.concatenate(received) if received else np.zeros((0, x.shape[1]), np.float32)
    return out, ws.close_code, error


async def enhance_stream(audio: np.ndarray, sample_rate: int, url: str = DEFAULT_URL, *, api_key: str | None = None,
                         atten_lim_db: float | None = None, speed: float = 1.0, chunk_ms: int = 20,
                         resume_overlap_s: float = 1.0, max_wait_s: float = 30.0, max_retries: int = 10,
                         on_message=None) -> np.ndarray:
    """Enhance `audio` ((frames,) or (frames, channels)) over the websocket; the result has its shape.
    `speed`: times real time (1 = a microphone; below 8 with 20 ms chunks, the server's default
    message-rate limit). Retries at most `max_retries` times in a row without progress, waiting the
    server's 1013 hint (at most `max_wait_s`) or a backoff while it restarts."""
    x = np.asarray(audio, "<f4")
    x = np.ascontiguousarray(x[:, None] if x.ndim == 1 else x)
    start = {"sample_rate": int(sample_rate), "encoding": "f32le", "channels": x.shape[1], "atten_lim_db": atten_lim_db}
    headers = {"X-API-Key": api_key} if api_key else {}
    out, done, tries, reached = [], 0, 0, False  # done: output samples kept (= input samples enhanced)
    while True:
        begin = max(0, done - int(resume_overlap_s * sample_rate)) if done else 0
        got, code, error = await _session(url, x[begin:], sample_rate, start, headers, speed, chunk_ms, on_message)
        got = got[done - begin:]  # drop the output of the overlap sent again
        out.append(got)
        done += len(got)
        if code == 1000:
            break
        if code is None and not reached:  # never reached the server: a wrong URL, or it is not running
            raise ConnectionError(f"cannot connect to {url}: {error['message']}")
        reached = True
        if code not in RESUME | {1013, None}:
            raise RuntimeError(f"stream closed with {code}: {error.get('message', '')}")
        tries = 0 if len(got) else tries + 1
        if tries > max_retries:
            raise RuntimeError(f"gave up after {max_retries} retries (last: {code}, {error.get('message', '')})")
        if code == 1013:  # over capacity: the server says when to come back
            wait = error.get("retry_after_s", 5.0)
        else:  # restarting or unreachable: back off
            wait = 0.25 * 2 ** max(tries - 1, 0)
        await asyncio.sleep(min(wait, max_wait_s))
    y = np.concatenate(out)
    if len(y) != len(x):
        raise RuntimeError(f"the server returned {len(y)} samples for {len(x)}")
    return y.reshape(np.shape(audio))


async def enhance_file(source, url: str = DEFAULT_URL, *, sample_rate: int | None = None, **options):
    """`source`: a file path (any format soundfile reads) or an array with `sample_rate`.
    Returns (enhanced audio, sample rate); `options` as for `enhance_stream`."""
    if isinstance(source, np.ndarray):
        if sample_rate is None:
            raise ValueError("an array needs its sample_rate")
        audio = source
    else:
        import soundfile as sf

        audio, sample_rate = sf.read(source, dtype="float32")
    return await enhance_stream(audio, sample_rate, url, **options), sample_rate


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Enhance a file through the websocket /v1/stream, as a live client.")
    p.add_argument("input")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--api-key", default=None)
    p.add_argument("--atten-lim-db", type=float, default=None)
    p.add_argument("--speed", type=float, default=1.0, help="times real time (default 1: a microphone's pace)")
    a = p.parse_args(argv)
    import soundfile as sf

    def show(msg):
        if msg.get("type") not in ("ready", "metadata"):
            print(json.dumps(msg))

    y, rate = asyncio.run(enhance_file(a.input, a.url, api_key=a.api_key, atten_lim_db=a.atten_lim_db,
                                       speed=a.speed, on_message=show))
    sf.write(a.output, y, rate)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
