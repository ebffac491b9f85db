"""Websocket /v1/stream against the real server: round trips, concurrency, disconnects, bad input."""
from __future__ import annotations

import asyncio
import json
import resource
import time

import numpy as np
import pytest
from websockets.asyncio.client import connect as aconnect
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.conftest import speechlike
from tests.tolerance import assert_close_to_peak, assert_differs

LSB = 1 / 32768


def to_bytes(x: np.ndarray, encoding: str) -> bytes:
    if encoding == "pcm_s16le":
        return np.clip(np.round(x * 32768), -32768, 32767).astype("<i2").tobytes()
    return x.astype("<f4").tobytes()


def from_bytes(data: bytes, encoding: str, channels: int) -> np.ndarray:
    dtype = "<i2" if encoding == "pcm_s16le" else "<f4"
    x = np.frombuffer(data, dtype).reshape(-1, channels).astype(np.float32)
    return x / 32768 if encoding == "pcm_s16le" else x


def stream_through(url: str, x: np.ndarray, sr: int, encoding: str, chunks, start: dict | None = None):
    """Send `x` (n, channels) in chunks of the given sizes, then end; returns (output, messages, close code)."""
    channels = x.shape[1]
    out, texts = [], []
    with connect(url, max_size=None) as ws:
        ws.send(json.dumps({"sample_rate": sr, "encoding": encoding, "channels": channels} | (start or {})))
        ready = json.loads(ws.recv(timeout=10))
        assert ready["type"] == "ready", ready
        texts.append(ready)
        i = 0
        for n in chunks:
            ws.send(to_bytes(x[i:i + n], encoding))
            i += n
        assert i == len(x)
        ws.send(json.dumps({"type": "end"}))
        try:
            while True:
                m = ws.recv(timeout=30)
                if isinstance(m, bytes):
                    out.append(from_bytes(m, encoding, channels))
                else:
                    texts.append(json.loads(m))
        except ConnectionClosed:
            pass
        code = ws.close_code
    y = np.concatenate(out) if out else np.zeros((0, channels), np.float32)
    return y, texts, code


async def astream_through(url: str, x: np.ndarray, sr: int, chunks, pause_s: float, realtime: bool = False):
    """Async client: send `x` (n, 1) as f32le in chunks of the given sizes, `pause_s` apart (with
    `realtime`: each chunk when its audio would have been recorded), while reading; then end.
    Returns (output, text messages after `ready`, close code)."""
    out, texts = [], []
    async with aconnect(url, max_size=None) as ws:
        await ws.send(json.dumps({"sample_rate": sr, "encoding": "f32le"}))
        assert json.loads(await ws.recv())["type"] == "ready"

        async def reader():
            async for m in ws:
                if isinstance(m, bytes):
                    out.append(from_bytes(m, "f32le", 1))
                else:
                    texts.append(json.loads(m))

        task = asyncio.create_task(reader())
        pos, t0 = 0, time.perf_counter()
        for n in chunks:
            await ws.send(to_bytes(x[pos:pos + n], "f32le"))
            pos += n
            await asyncio.sleep(max(t0 + pos / sr - time.perf_counter(), 0) if realtime else pause_s)
        assert pos == len(x)
        await ws.send(json.dumps({"type": "end"}))
        await task
        return np.concatenate(out), texts, ws.close_code


def random_chunks(n: int, rng, low=1, high=6000):
    sizes = []
    while sum(sizes) < n:
        sizes.append(int(min(rng.integers(low, high), n - sum(sizes))))
    return sizes


@pytest.mark.parametrize("sr,channels,encoding", [(48000, 1, "f32le"), (16000, 1, "pcm_s16le"),
                                                   (44100, 2, "pcm_s16le"), (8000, 2, "f32le")])
def test_round_trip_random_chunks_equals_offline(live, enhancer_rt, sr, channels, encoding):
    rng = np.random.default_rng(sr + channels)
    x = speechlike(int(1.3 * sr), sr, seed=sr, channels=channels if channels > 1 else 0).reshape(int(1.3 * sr), channels)
    sent = from_bytes(to_bytes(x, encoding), encoding, channels)  # what the server decodes
    y, texts, code = stream_through(live.ws_url, x, sr, encoding, random_chunks(len(x), rng))
    assert code == 1000
    assert texts[-1] == {"type": "end", "samples": len(x)}
    # 48 ms of the model's delay (64 ms with its window) and 2 x 6.6875 ms of the resamplers' (13.375 at 8 kHz)
    want = {48000: (2946, 77.375), 16000: (768, 64.0), 44100: (2707, 64 + 6.6875 + 295 / 44.1), 8000: (598, 90.75)}[sr]
    assert texts[0]["delay_samples"] == want[0] and texts[0]["latency_ms"] == pytest.approx(want[1], rel=1e-9)
    ref = enhancer_rt.enhance(sent if channels > 1 else sent[:, 0], sr).reshape(sent.shape)
    assert y.shape == x.shape
    if encoding == "f32le":
        assert_close_to_peak(y, ref)
    else:  # half a 16-bit step of rounding on the way out
        assert_close_to_peak(y, np.clip(ref, -1, 1), plus=LSB * 0.5)


def test_metadata_frames(live, enhancer_rt):
    sr, n = 16000, 16000
    x = speechlike(n, sr, seed=4)[:, None]
    y, texts, code = stream_through(live.ws_url, x, sr, "f32le", [1600] * 10, {"metadata": True})
    assert code == 1000 and len(y) == n
    frames = [f for t in texts if t["type"] == "metadata" for f in t["frames"]]
    cfg = enhancer_rt.config
    # one frame per 16 ms hop of output: the input's hops, none of the delay-only ones
    assert len(frames) >= n // cfg.stft.hop
    assert [f["frame"] for f in frames] == list(range(frames[0]["frame"], frames[0]["frame"] + len(frames)))
    comp = np.array([f["competition"] for f in frames])  # (frames, channels, tim layers, mechanisms)
    assert comp.shape[1:] == (1, cfg.n_tim_layers, cfg.n_mechanisms)
    np.testing.assert_allclose(comp.sum(-1), 1.0, atol=2e-3)  # a competition: scores sum to one
    act = np.array([f["activity"] for f in frames])
    assert act.shape == (len(frames), 1) and ((act >= 0) & (act <= 1)).all()
    assert frames[0]["time_s"] == 0.0


def test_16_concurrent_streams_get_their_own_audio(live, enhancer_rt):
    sr = 16000
    signals = [speechlike(int(sr * 1.5), sr, seed=100 + i)[:, None] for i in range(16)]
    batches_before = (live.metrics.batch_size._sum.get(), sum(b.get() for b in live.metrics.batch_size._buckets))

    async def one(i):
        x = signals[i]
        # paced as live microphones: batching across streams is what live audio gets
        y, _, code = await astream_through(live.ws_url, x, sr, random_chunks(len(x), np.random.default_rng(i), 200, 2000),
                                           0.002, realtime=True)
        assert code == 1000
        return y

    async def all_streams():
        return await asyncio.gather(*(one(i) for i in range(16)))

    outputs = asyncio.run(all_streams())
    for x, y in zip(signals, outputs):
        ref = enhancer_rt.enhance(x[:, 0], sr)[:, None]
        assert y.shape == x.shape
        assert_close_to_peak(y, ref)
    # the scheduler really batched streams together
    s, c = live.metrics.batch_size._sum.get(), sum(b.get() for b in live.metrics.batch_size._buckets)
    assert (s - batches_before[0]) / (c - batches_before[1]) > 2.0
    live.wait_idle()


def _rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_disconnect_mid_stream_frees_state(live):
    """200 clients that vanish mid-stream (no end message, some mid-send): no stream, lane or memory left."""
    chunk = to_bytes(speechlike(4000, 16000, seed=1), "pcm_s16le")

    async def vanish(i):
        ws = await aconnect(live.ws_url)
        await ws.send(json.dumps({"sample_rate": 16000, "metadata": i % 2 == 0}))
        await ws.recv()
        for _ in range(1 + i % 3):
            await ws.send(chunk)
        if i % 2:
            ws.transport.abort()  # no close handshake at all
        else:
            await ws.close()

    async def run(rounds):
        for r in range(rounds):
            await asyncio.gather(*(vanish(r * 10 + k) for k in range(10)))

    asyncio.run(run(4))  # warm-up: allocator and caches reach their working size
    live.wait_idle()
    rss0, opened0, audio0 = _rss_mb(), live.scheduler.opened, live.metrics.stream_seconds._value.get()
    asyncio.run(run(20))
    live.wait_idle()
    assert live.scheduler.opened - opened0 == 200
    assert live.metrics.stream_seconds._value.get() - audio0 > 0.5 * 200 * 2 * 0.25  # most audio did arrive
    grown = _rss_mb() - rss0
    assert live.scheduler.streams == 0 and not live.scheduler.jobs
    assert all(ledger.free == ledger.size and ledger.live == 0 for ledger in live.scheduler.ledgers)
    assert all(w.live_lanes == 0 for w in live.scheduler.workers)
    assert grown < 40, f"memory grew by {grown:.0f} MB over 200 disconnects"


# ---------------------------------------------------------------------------------- bad input
def expect_close(url: str, messages, code: int, kind: str | None = None, words: str = "", start=True, **kw):
    """Send `messages` and expect an error JSON then close `code`."""
    with connect(url, max_size=None, **kw) as ws:
        if start:
            ws.send(json.dumps({"sample_rate": 16000, "encoding": "pcm_s16le"} if start is True else start))
        texts = []
        try:
            for m in messages:
                ws.send(m)
        except ConnectionClosed:  # the server may answer and close before a big message is all sent
            pass
        try:
            while True:  # what arrived before the close frame is still read
                m = ws.recv(timeout=10)
                if isinstance(m, str):
                    texts.append(json.loads(m))
        except ConnectionClosed:
            pass
        assert ws.close_code == code, (ws.close_code, ws.close_reason, texts)
    errors = [t for t in texts if t["type"] == "error"]
    if kind is not None:
        assert errors and errors[-1]["kind"] == kind and errors[-1]["code"] == code, texts
        assert words.lower() in errors[-1]["message"].lower(), errors


def test_text_frame_where_audio_belongs(live):
    expect_close(live.ws_url, [b"\x00\x00" * 100, "here is some audio"], 1003, "unsupported_media", "binary")


def test_unknown_encoding(live):
    expect_close(live.ws_url, [], 1003, "unsupported_media", "encoding", start={"encoding": "mp3"})


@pytest.mark.parametrize("rate", [5, 10_000_000, "fast"])
def test_absurd_sample_rate(live, rate):
    expect_close(live.ws_url, [], 1007, "invalid_parameter", "sample", start={"sample_rate": rate})


def test_bad_start_fields(live):
    expect_close(live.ws_url, [], 1007, "invalid_parameter", "channels", start={"channels": 99})
    expect_close(live.ws_url, [], 1007, "invalid_parameter", "unknown", start={"samplerate": 16000})
    expect_close(live.ws_url, [], 1007, "invalid_parameter", "atten_lim_db", start={"atten_lim_db": -1})
    expect_close(live.ws_url, [], 1007, "bad_request", "start message", start=["not", "an", "object"])


def test_a_long_non_ascii_error_still_closes_cleanly(live):
    """The error names the unknown fields; as a close reason it is cut to 123 bytes of UTF-8 between
    characters (4-byte characters from the 120th on), so the close frame still goes out."""
    from server.api.ws import close_reason

    start = {"\U00010000" * 3: None, "\U00010000": None, "0000": None}
    expect_close(live.ws_url, [], 1007, "invalid_parameter", "unknown", start=start)
    reason = close_reason("x" * 121 + "\U00010000")
    assert reason == "x" * 121 and len(close_reason("é" * 100).encode()) == 122


def test_partial_sample_frame(live):
    expect_close(live.ws_url, [b"\x01\x02\x03"], 1007, "invalid_audio", "whole number")


def test_nan_samples(live):
    x = np.zeros(1000, "<f4")
    x[10] = np.inf
    expect_close(live.ws_url, [x.tobytes()], 1007, "invalid_audio", "nan",
                 start={"sample_rate": 16000, "encoding": "f32le"})


def test_second_start_message(live):
    expect_close(live.ws_url, [json.dumps({"sample_rate": 16000})], 1007, "bad_request", "first message")


def test_message_too_big(live):
    big = bytes(live.settings.max_message_bytes + 2)
    expect_close(live.ws_url, [big], 1009, "too_large", "limit")


@pytest.fixture(scope="module")
def live_1mib(model_path):
    """A server with the default message limit (1 MiB)."""
    from server.settings import Settings

    from .conftest import TEST_LIMITS, LiveServer

    srv = LiveServer(model=model_path, **{k: v for k, v in TEST_LIMITS.items() if k != "max_message_bytes"})
    assert srv.settings.max_message_bytes == Settings().max_message_bytes == 1 << 20
    yield srv
    srv.stop()


@pytest.mark.parametrize("mib", [1.02, 1.07, 1.5, 8.0])
@pytest.mark.parametrize("kind", ["bytes", "text"])
def test_every_oversized_message_gets_the_json_error_and_1009(live_1mib, mib, kind):
    """Just over the limit (seen by the handler) and far over it (refused by the protocol layer from
    the frame's header): the same answer, the JSON error and close 1009, never a bare close."""
    n = int(mib * (1 << 20))
    big = bytes(n) if kind == "bytes" else " " * n
    expect_close(live_1mib.ws_url, [big], 1009, "too_large", f"over the limit of {1 << 20} bytes")
    expect_close(live_1mib.ws_url, [big], 1009, "too_large", f"{n} bytes")
    assert live_1mib.metrics.errors.labels(kind="too_large")._value.get() > 0


def flood(url: str, n: int):
    """Send `n` one-sample messages as fast as possible; returns (messages sent, texts, close code)."""
    texts, sent = [], 0
    with connect(url, max_size=None) as ws:
        ws.send(json.dumps({"sample_rate": 16000, "encoding": "pcm_s16le"}))
        assert json.loads(ws.recv(timeout=10))["type"] == "ready"
        try:
            for _ in range(n):
                ws.send(b"\x01\x00")
                sent += 1
            ws.send(json.dumps({"type": "end"}))
        except ConnectionClosed:
            pass
        try:
            while True:
                m = ws.recv(timeout=30)
                if isinstance(m, str):
                    texts.append(json.loads(m))
        except ConnectionClosed:
            pass
        return sent, texts, ws.close_code


def test_message_flood_is_rate_limited(live, enhancer_rt):
    """2,000 one-sample messages as fast as the client can: closed with 1008 (rate_limited) after
    the burst allowance; the server keeps serving."""
    limit = live.settings.max_messages_per_s
    errors0 = live.metrics.errors.labels(kind="rate_limited")._value.get()
    audio0 = live.metrics.stream_seconds._value.get()
    sent, texts, code = flood(live.ws_url, 2000)
    errors = [t for t in texts if t["type"] == "error"]
    assert code == 1008, (code, sent, texts)
    assert errors and errors[-1]["kind"] == "rate_limited" and errors[-1]["code"] == 1008, texts
    assert "messages per second" in errors[-1]["message"], errors
    assert not any(t["type"] == "end" for t in texts), texts
    accepted = round((live.metrics.stream_seconds._value.get() - audio0) * 16000)  # one sample per message
    assert limit - 1 <= accepted < 2000, accepted  # the burst (one second's worth, less the start message) passed
    assert live.metrics.errors.labels(kind="rate_limited")._value.get() == errors0 + 1
    live.wait_idle()
    x = speechlike(8000, 16000, seed=14)[:, None]
    y, _, code = stream_through(live.ws_url, x, 16000, "f32le", [320] * 25)
    assert code == 1000
    assert_close_to_peak(y[:, 0], enhancer_rt.enhance(x[:, 0], 16000))


def test_paced_client_is_not_rate_limited(live, enhancer_rt):
    """20 ms chunks for 4 s, sent at twice real time (100 messages/s): untouched by the limit."""
    sr, chunk = 16000, 320
    x = speechlike(4 * sr, sr, seed=15)[:, None]
    errors0 = live.metrics.errors.labels(kind="rate_limited")._value.get()
    y, texts, code = asyncio.run(astream_through(live.ws_url, x, sr, [chunk] * (len(x) // chunk), 0.01))
    assert all(t["type"] == "end" for t in texts), texts
    assert code == 1000
    assert_close_to_peak(y[:, 0], enhancer_rt.enhance(x[:, 0], sr))
    assert live.metrics.errors.labels(kind="rate_limited")._value.get() == errors0
    live.wait_idle()


def test_too_many_streams(live_auth):
    key = {"additional_headers": {"X-API-Key": "s3cret-key"}}
    with connect(live_auth.ws_url, **key) as a, connect(live_auth.ws_url, **key) as b:
        for ws in (a, b):
            ws.send(json.dumps({"sample_rate": 16000}))
            assert json.loads(ws.recv(timeout=10))["type"] == "ready"
        # refused at the handshake, before any start message: the JSON error names the capacity
        expect_close(live_auth.ws_url, [], 1013, "over_capacity", "capacity", start=False, **key)
    live_auth.wait_idle()
    expect_close(live_auth.ws_url, [json.dumps({"type": "end"})], 1000, **key)


def test_idle_timeout(live_auth):
    with connect(live_auth.ws_url + "?api_key=s3cret-key") as ws:
        ws.send(json.dumps({"sample_rate": 16000}))
        assert json.loads(ws.recv(timeout=10))["type"] == "ready"
        t = time.time()
        msg = json.loads(ws.recv(timeout=10))
        assert msg["kind"] == "idle_timeout" and msg["code"] == 1008
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
        assert ws.close_code == 1008
        assert 0.5 < time.time() - t < 5


def test_api_key(live_auth):
    url = live_auth.ws_url
    expect_close(url, [], 1008, "unauthorized", "api key", start=False)
    expect_close(url + "?api_key=wrong", [], 1008, "forbidden", "not valid", start=False)
    expect_close(url, [], 1008, "forbidden", start=False, additional_headers={"X-API-Key": "nope"})
    # the right key, by query or header: a normal (empty) stream
    expect_close(url + "?api_key=s3cret-key", [json.dumps({"type": "end"})], 1000)
    expect_close(url, [json.dumps({"type": "end"})], 1000, additional_headers={"X-API-Key": "s3cret-key"})


def test_empty_stream_ends_cleanly(live):
    y, texts, code = stream_through(live.ws_url, np.zeros((0, 1), np.float32), 16000, "f32le", [])
    assert code == 1000 and y.shape == (0, 1) and texts[-1] == {"type": "end", "samples": 0}


def test_binary_first_uses_defaults(live, enhancer_rt):
    """No start message: 16 kHz mono pcm_s16le."""
    x = speechlike(8000, 16000, seed=11)
    data = to_bytes(x, "pcm_s16le")
    out = []
    with connect(live.ws_url) as ws:
        ws.send(data)
        ready = json.loads(ws.recv(timeout=10))
        assert ready["sample_rate"] == 16000 and ready["encoding"] == "pcm_s16le"
        ws.send(json.dumps({"type": "end"}))
        try:
            while True:
                m = ws.recv(timeout=10)
                if isinstance(m, bytes):
                    out.append(from_bytes(m, "pcm_s16le", 1))
        except ConnectionClosed:
            pass
        assert ws.close_code == 1000
    ref = enhancer_rt.enhance(from_bytes(data, "pcm_s16le", 1)[:, 0], 16000)
    assert_close_to_peak(np.concatenate(out)[:, 0], np.clip(ref, -1, 1), plus=LSB * 0.5)


def test_server_keeps_serving(live, enhancer_rt):
    """After all the errors above, a stream still round-trips and nothing is left behind."""
    x = speechlike(16000, 16000, seed=12)[:, None]
    y, _, code = stream_through(live.ws_url, x, 16000, "f32le", [3000] * 5 + [1000])
    assert code == 1000
    assert_close_to_peak(y[:, 0], enhancer_rt.enhance(x[:, 0], 16000))
    live.wait_idle()


def test_inference_failure_closes_1011_and_server_recovers(live, enhancer_rt, monkeypatch):
    def broken_run(*args, **kwargs):  # every call of the lane pool (a live step is a one-frame run)
        raise RuntimeError("injected inference failure")

    for w in live.scheduler.workers:
        monkeypatch.setattr(w.pool, "run", broken_run)
    expect_close(live.ws_url, [to_bytes(speechlike(4000, 16000), "pcm_s16le")], 1011, "internal", "inference failed")
    monkeypatch.undo()
    live.wait_idle()
    x = speechlike(8000, 16000, seed=13)[:, None]
    y, _, code = stream_through(live.ws_url, x, 16000, "f32le", [4000, 4000])
    assert code == 1000
    assert_close_to_peak(y[:, 0], enhancer_rt.enhance(x[:, 0], 16000))


@pytest.mark.parametrize("sr,channels", [(44100, 2), (48000, 1)])
def test_band_start_field(live, enhancer_rt, sr, channels):
    """Full band is the default above 16 kHz; "band": "speech" gives the model's band only."""
    rng = np.random.default_rng(sr)
    x = speechlike(int(1.1 * sr), sr, seed=3, channels=channels if channels > 1 else 0).reshape(-1, channels)
    x = (x + 0.02 * rng.standard_normal(x.shape)).astype(np.float32)
    mono = (lambda a: a) if channels > 1 else (lambda a: a[:, 0])
    for band in ("full", "speech", None):
        start = {"atten_lim_db": 12} | ({} if band is None else {"band": band})  # 12 dB: the upper band floored open
        y, texts, code = stream_through(live.ws_url, x, sr, "f32le", random_chunks(len(x), rng), start)
        assert code == 1000 and y.shape == x.shape
        assert texts[0]["band"] == (band or "full")
        ref = enhancer_rt.enhance(mono(x), sr, 12, band=band or "full").reshape(x.shape)
        assert_close_to_peak(y, ref)
        if band == "speech":
            assert_differs(ref, enhancer_rt.enhance(mono(x), sr, 12).reshape(x.shape))


def test_bad_band_field(live):
    expect_close(live.ws_url, [], 1007, "invalid_parameter", "band", start={"band": "wide"})
