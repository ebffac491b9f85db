"""The package's client (enhancer.client) against the real service: REST files and live streams
equal offline enhancement, a stream waits out a full service (1013) and resumes after a restart
(1012) without losing or repeating audio, errors carry the service's kind, bad local input fails
with the command line's own message, and `enhancer stream` streams a file."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from websockets.sync.client import connect

import server
from enhancer.client import Client, ClientError, enhance_stream, urls
from enhancer.errors import AudioDecodeError, AudioError, EmptyAudioError
from server.settings import Settings
from tests.conftest import broken_audio, core_message, speechlike
from tests.server.conftest import TEST_LIMITS, LiveServer
from tests.tolerance import assert_close_to_peak

SR = 16000
ROOT = Path(__file__).resolve().parents[2]
LSB = 1.01 / 32768  # one step of 16-bit PCM


def test_addresses():
    assert urls("http://h:1") == ("http://h:1/v1/enhance", "ws://h:1/v1/stream")
    assert urls("ws://h:1/v1/stream") == ("http://h:1/v1/enhance", "ws://h:1/v1/stream")
    assert urls("https://h/api/v1/enhance/") == ("https://h/api/v1/enhance", "wss://h/api/v1/stream")
    with pytest.raises(ClientError) as e:
        Client("h:1")
    assert e.value.kind == "invalid_url"


# ---------------------------------------------------------------------------------------------- REST
def test_rest_files_equal_offline_in_the_container_asked_for(live, enhancer_rt, tmp_path):
    x = speechlike(int(1.2 * SR), SR, seed=81, channels=2)
    sf.write(tmp_path / "noisy.wav", x, SR, subtype="PCM_16")
    decoded, _ = sf.read(tmp_path / "noisy.wav", dtype="float32")
    client = Client(live.base)
    facts = client.enhance_file(tmp_path / "noisy.wav", tmp_path / "clean.wav")
    assert facts == {"path": str(tmp_path / "clean.wav"), "sample_rate": SR, "channels": 2, "frames": len(x)}
    y, rate = sf.read(tmp_path / "clean.wav", dtype="float32")
    assert rate == SR and sf.info(tmp_path / "clean.wav").subtype == "PCM_16"
    assert_close_to_peak(y, np.clip(enhancer_rt.enhance(decoded, SR), -1, 1), plus=LSB)
    # the container follows the extension (as `enhancer denoise`), and the options go along
    client.enhance_file(tmp_path / "noisy.wav", tmp_path / "clean.flac", level="input", atten_lim_db=12)
    assert sf.info(tmp_path / "clean.flac").format == "FLAC"
    y, _ = sf.read(tmp_path / "clean.flac", dtype="float32")
    assert_close_to_peak(y, np.clip(enhancer_rt.enhance(decoded, SR, 12, level="input"), -1, 1), plus=LSB)
    assert not list(tmp_path.glob("*.part"))


def test_rest_errors_carry_the_service_kind(live, live_auth, tmp_path):
    sf.write(tmp_path / "noisy.wav", speechlike(SR // 2, SR, seed=82), SR)
    with pytest.raises(ClientError) as e:
        Client(live.base).enhance_file(tmp_path / "noisy.wav", tmp_path / "out.wav", atten_lim_db=-3)
    assert (e.value.kind, e.value.status) == ("invalid_parameter", 422) and "atten_lim_db" in e.value.message
    with pytest.raises(ClientError) as e:
        Client(live_auth.base).enhance_file(tmp_path / "noisy.wav", tmp_path / "out.wav")
    assert (e.value.kind, e.value.status) == ("unauthorized", 401)
    with pytest.raises(ClientError) as e:
        Client(live_auth.base, api_key="wrong").enhance_file(tmp_path / "noisy.wav", tmp_path / "out.wav")
    assert (e.value.kind, e.value.status) == ("forbidden", 403)
    Client(live_auth.base, api_key="s3cret-key").enhance_file(tmp_path / "noisy.wav", tmp_path / "out.wav")
    assert sf.info(tmp_path / "out.wav").frames == SR // 2
    with pytest.raises(TypeError, match="unknown option"):
        Client(live.base).enhance_file(tmp_path / "noisy.wav", tmp_path / "out.wav", loudness=3)


@pytest.mark.parametrize("name", ["truncated.wav", "junk.wav", "nan.wav", "empty.wav"])
def test_bad_local_files_fail_with_the_command_line_message_before_anything_is_sent(live, tmp_path, name):
    data = broken_audio()[name]
    src = tmp_path / name
    src.write_bytes(data)
    before = live.metrics.rest_requests.labels(status="200")._value.get()
    for call in (lambda: Client(live.base).enhance_file(src, tmp_path / "out.wav"),
                 lambda: asyncio.run(Client(live.base).stream_file(src, tmp_path / "out.wav", speed=0))):
        with pytest.raises(AudioError) as e:
            call()
        if data:
            assert str(e.value) == f"{src}: {core_message(data)}"
        else:
            assert isinstance(e.value, EmptyAudioError)
        if name == "truncated.wav":
            assert isinstance(e.value, AudioDecodeError) and "truncated" in str(e.value)
    assert not list(tmp_path.glob("out.*"))
    assert live.metrics.rest_requests.labels(status="200")._value.get() == before
    # the command line says the same, in one line
    denoise = subprocess.run([sys.executable, "-m", "enhancer", "denoise", str(src), "-o", str(tmp_path / "d.wav")],
                             capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    stream = subprocess.run([sys.executable, "-m", "enhancer", "stream", str(src), "-o", str(tmp_path / "s.wav"),
                             "--url", live.base], capture_output=True, text=True, cwd=tmp_path,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert stream.returncode == 2 and stream.stderr.strip().splitlines() == [f"error: {e.value}"], stream.stderr
    assert f"error: {e.value}" in denoise.stderr


def test_no_service_fails_at_once_in_one_line(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sf.write(tmp_path / "noisy.wav", speechlike(SR // 4, SR), SR)
    try:
        t = time.perf_counter()
        with pytest.raises(ClientError) as e:
            Client(base).enhance_file(tmp_path / "noisy.wav", tmp_path / "out.wav")
        assert e.value.kind == "unreachable" and "cannot reach" in str(e.value)
        with pytest.raises(ClientError) as e:
            asyncio.run(enhance_stream(np.zeros(SR, np.float32), SR, base))
        assert e.value.kind == "unreachable"
        assert time.perf_counter() - t < 5
        r = subprocess.run([sys.executable, "-m", "enhancer", "stream", "noisy.wav", "-o", "out.wav", "--url", base],
                           capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: cannot reach the service at ")
    finally:
        sock.close()


# ---------------------------------------------------------------------------------------------- streams
def test_a_stream_of_chunks_of_any_size_equals_offline(live, enhancer_rt):
    """PCM of any size goes in while the enhanced PCM comes out; mono comes back (n,), several
    channels (n, channels); int16 is taken as PCM; every JSON message reaches on_message."""
    rng = np.random.default_rng(83)
    x = speechlike(int(1.5 * SR), SR, seed=83)
    x2 = speechlike(SR, SR, seed=84, channels=2)
    messages = []

    async def run(audio, channels, **kw):
        out = []
        async with Client(live.base).stream(SR, channels, **kw) as s:
            async def produce():
                i = 0
                while i < len(audio):
                    k = int(rng.integers(1, 4000))
                    await s.send(audio[i:i + k])
                    i += k
                    await asyncio.sleep(0.005)
                await s.end()

            task = asyncio.create_task(produce())
            async for y in s:
                out.append(y)
            await task
        return np.concatenate(out), s

    y, s = asyncio.run(run(x, 1, metadata=True, on_message=messages.append))
    assert y.shape == x.shape and s.samples_out == s.samples_in == len(x) and s.sessions == 1
    assert_close_to_peak(y, enhancer_rt.enhance(x, SR))
    assert messages[0]["type"] == "ready" and messages[-1] == {"type": "end", "samples": len(x)}
    frames = [f for m in messages if m["type"] == "metadata" for f in m["frames"]]
    assert len(frames) == -(-len(x) // 256) and all(len(f["activity"]) == 1 for f in frames)
    y2, _ = asyncio.run(run(x2, 2, level="input"))
    assert y2.shape == x2.shape
    assert_close_to_peak(y2, enhancer_rt.enhance(x2, SR, level="input"))
    pcm = np.round(x * 32767).astype(np.int16)
    y3 = asyncio.run(enhance_stream(pcm, SR, live.base, speed=0))
    assert_close_to_peak(y3, enhancer_rt.enhance(pcm.astype(np.float32) / 32768, SR))
    live.wait_idle()


def test_stream_errors_carry_the_service_kind(live, live_auth):
    async def run(client, **kw):
        async with client.stream(SR, 1, **kw) as s:
            await s.send(np.zeros(SR // 10, np.float32))
            return await s.finish()

    with pytest.raises(ClientError) as e:
        asyncio.run(run(Client(live.base), band="wide"))
    assert (e.value.kind, e.value.status) == ("invalid_parameter", 1007) and "band" in e.value.message
    with pytest.raises(ClientError) as e:
        asyncio.run(run(Client(live_auth.base)))
    assert (e.value.kind, e.value.status) == ("unauthorized", 1008)
    assert len(asyncio.run(run(Client(live_auth.base, api_key="s3cret-key")))) == SR // 10
    with pytest.raises(AudioError, match="NaN"):  # bad local input: the core's own error
        asyncio.run(_send_nan(live))


async def _send_nan(live):
    async with Client(live.base).stream(SR, 1) as s:
        await s.send(np.full(100, np.nan, np.float32))


def test_over_capacity_waits_the_hint_and_gets_in(model_path, enhancer_rt):
    srv = LiveServer(model=model_path, **(TEST_LIMITS | dict(max_streams=1, capacity=1)))
    try:
        x = speechlike(SR // 2, SR, seed=85)
        messages = []

        async def run():
            with connect(srv.ws_url) as blocker:  # holds the only place
                blocker.send(json.dumps({"sample_rate": SR}))
                assert json.loads(blocker.recv(timeout=10))["type"] == "ready"
                client = asyncio.create_task(enhance_stream(x, SR, srv.base, speed=4, max_wait_s=0.2,
                                                            max_retries=100, on_message=messages.append))
                while not any(m.get("code") == 1013 for m in messages):
                    assert not client.done(), client
                    await asyncio.sleep(0.05)
            return await client  # the blocker has gone: the retry is admitted

        y = asyncio.run(run())
        refusals = [m for m in messages if m.get("type") == "error"]
        assert refusals and all(m["kind"] == "over_capacity" and m["code"] == 1013 for m in refusals), refusals
        assert refusals[0]["retry_after_s"] > 0 and refusals[0]["capacity"] == 1
        assert messages[-1] == {"type": "end", "samples": len(x)}
        assert_close_to_peak(y, enhancer_rt.enhance(x, SR))
        # a service that stays full: given up after max_retries, with its kind
        with connect(srv.ws_url) as blocker:
            blocker.send(json.dumps({"sample_rate": SR}))
            assert json.loads(blocker.recv(timeout=10))["type"] == "ready"
            with pytest.raises(ClientError) as e:
                asyncio.run(enhance_stream(x, SR, srv.base, max_wait_s=0.05, max_retries=2))
        assert e.value.kind == "over_capacity" and "gave up after 2 tries" in e.value.message
    finally:
        srv.stop()


def _serve_on(port: int, model_path, **limits):
    """A server on a given loopback port (a restart of one that was there), with TEST_LIMITS and
    `limits`: (uvicorn server, thread)."""
    settings = Settings.build(model=model_path, **(TEST_LIMITS | limits))
    app = server.create_app(settings)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    srv = server.Server(server.uvicorn_config(app, settings, port=port, log_level="warning"), app)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not srv.started:
        assert thread.is_alive() and time.time() < deadline, "restarted server did not start"
        time.sleep(0.02)
    return srv, thread


def _best_lag(y: np.ndarray, ref: np.ndarray, most: int = 64) -> int:
    """The shift of `y` against `ref` that matches best."""
    n = len(ref) - 2 * most
    errors = {lag: float(np.sum((y[most + lag:most + lag + n] - ref[most:most + n]) ** 2))
              for lag in range(-most, most + 1)}
    return min(errors, key=errors.get)


def _restart_mid_stream(model_path, x, first_limits: dict, overlap_s: float = 1.0):
    """Stream `x` at real-time pace; 1 s in, the service drains (close 1012) and nothing listens
    for 0.5 s, then a new one is there on the same port: (output, the stream, its messages)."""
    first = LiveServer(model=model_path, **(TEST_LIMITS | dict(drain_timeout_s=0.3) | first_limits))
    second = None
    messages = []
    try:
        async def run():
            nonlocal second
            client = Client(first.base)
            async with client.stream(SR, 1, resume_overlap_s=overlap_s, on_message=messages.append) as s:
                async def produce():
                    loop = asyncio.get_running_loop()
                    t0 = loop.time()
                    for i in range(0, len(x), 320):
                        await s.send(x[i:i + 320])
                        await asyncio.sleep(max(0.0, t0 + (i + 320) / SR - loop.time()))
                    await s.end()

                task = asyncio.create_task(produce())
                await asyncio.sleep(1.0)
                await asyncio.to_thread(first.stop)  # drains: end "shutdown", close 1012
                await asyncio.sleep(0.5)  # nothing listens meanwhile: the client backs off and retries
                second = await asyncio.to_thread(_serve_on, first.port, model_path)
                await task
                y = await s.finish()
            return y, s

        y, s = asyncio.run(run())
        return y, s, messages
    finally:
        first.stop()
        if second is not None:
            second[0].should_exit = True
            second[1].join(timeout=15)


def test_a_restart_mid_stream_is_continued_from_its_state_as_if_uninterrupted(model_path, enhancer_rt):
    """The service drains: the output of every whole hop it read, a "state" message, end "shutdown",
    1012; the client hands the state to the next replica and sends the input from where the state
    stops: the whole output equals the uninterrupted run's, sample for sample."""
    x = speechlike(3 * SR, SR, seed=86)
    y, s, messages = _restart_mid_stream(model_path, x, {})
    states = [m for m in messages if m.get("type") == "state"]
    ends = [m for m in messages if m.get("type") == "end"]
    readies = [m for m in messages if m.get("type") == "ready"]
    assert len(states) == 1 and len(ends) == 2 and ends[0]["reason"] == "shutdown", ends
    at_in, at_out = states[0]["input_samples"], states[0]["output_samples"]
    assert 0 < at_out < at_in < len(x) and ends[0]["samples"] == at_out
    assert readies[1]["resumed"] == {"input_samples": at_in, "output_samples": at_out}
    assert s.sessions == 2 and s.resumed == 1 and ends[1] == {"type": "end", "samples": len(x)}
    assert y.shape == x.shape
    # (the offline run groups hops into calls of many frames, the live one steps them one by one)
    assert_close_to_peak(y, enhancer_rt.enhance(x, SR), rel=3e-4)


def test_a_state_the_service_refuses_is_dropped_and_the_stream_starts_afresh(live, enhancer_rt):
    """A state in hand that the replica cannot read (invalid_state, 1007) is not a failure of the
    stream: the client drops it and connects again without it."""
    x = speechlike(SR, SR, seed=88)
    messages = []

    async def run():
        s = Client(live.base).stream(SR, 1, on_message=messages.append)
        s._resume.state = {"state": b"\x01" * 5000, "input_samples": 0, "output_samples": 0}
        async with s:
            await s.send(x)
            return await s.finish(), s

    y, s = asyncio.run(run())
    errors = [m for m in messages if m.get("type") == "error"]
    assert [e["kind"] for e in errors] == ["invalid_state"] and s.sessions == 1 and s.resumed == 0
    assert_close_to_peak(y, enhancer_rt.enhance(x, SR))


@pytest.mark.parametrize("overlap_s", [0.0, 0.5])
def test_a_restart_without_a_state_is_resumed_without_losing_or_repeating_audio(model_path, enhancer_rt, overlap_s):
    """A service that cannot hand the state over (over its max_state_bytes) sends the tail of all it
    read instead (end "shutdown", 1012); the client resumes there: the output has the input's length;
    before the restart it is the uninterrupted run's own output (but for the model's lookahead
    before the restart point), after it a new stream's from `overlap_s` before the restart point, at
    lag 0 against the uninterrupted run (nothing lost, nothing repeated)."""
    x = speechlike(3 * SR, SR, seed=86)
    y, s, messages = _restart_mid_stream(model_path, x, dict(max_state_bytes=1024), overlap_s)
    ends = [m for m in messages if m.get("type") == "end"]
    assert len(ends) == 2 and ends[0]["reason"] == "shutdown" and "reason" not in ends[1], ends
    assert s.sessions == 2 and s.resumed == 0 and not any(m.get("type") == "state" for m in messages)
    n = ends[0]["samples"]  # what the first server read and enhanced
    assert 0 < n < len(x) and y.shape == x.shape
    whole = enhancer_rt.enhance(x, SR)
    # the first stream's output, tail included: the uninterrupted run's, but for the last 48 ms
    # before n, enhanced without the lookahead that came after the drain
    assert_close_to_peak(y[:n], enhancer_rt.enhance(x[:n], SR))
    lookahead = enhancer_rt.config.delay_samples
    # (offline runs of different lengths group the hops into calls differently: a few float32 ulps more)
    assert_close_to_peak(y[:n - lookahead], whole[:n - lookahead], rel=3e-4)
    begin = max(0, n - int(overlap_s * SR))
    assert ends[1]["samples"] == len(x) - begin
    assert_close_to_peak(y[n:], enhancer_rt.enhance(x[begin:], SR)[n - begin:])
    assert _best_lag(y[n:], whole[n:]) == 0


# ---------------------------------------------------------------------------------------------- enhancer stream
def test_enhancer_stream_writes_the_file(live, enhancer_rt, tmp_path):
    x = speechlike(SR // 2, SR, seed=87, channels=2)
    sf.write(tmp_path / "noisy.flac", x, SR)
    decoded, _ = sf.read(tmp_path / "noisy.flac", dtype="float32")
    r = subprocess.run([str(Path(sys.executable).with_name("enhancer")), "stream", "noisy.flac", "-o", "clean.wav",
                        "--url", live.base, "--level", "input", "--speed", "4"], capture_output=True, text=True,
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().endswith("(1 connection(s)) to clean.wav"), r.stderr
    y, rate = sf.read(tmp_path / "clean.wav", dtype="float32")
    assert rate == SR and y.shape == x.shape and sf.info(tmp_path / "clean.wav").subtype == "PCM_16"
    assert_close_to_peak(y, np.clip(enhancer_rt.enhance(decoded, SR, level="input"), -1, 1), plus=LSB)
    # --fast, through `python -m enhancer`, to the input's own container, the websocket's address given
    r = subprocess.run([sys.executable, "-m", "enhancer", "stream", "noisy.flac", "-o", "fast.flac", "--url",
                        live.ws_url, "--fast", "-q"], capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    y, _ = sf.read(tmp_path / "fast.flac", dtype="float32")
    assert_close_to_peak(y, np.clip(enhancer_rt.enhance(decoded, SR), -1, 1), plus=LSB)


def test_enhancer_stream_tells_of_a_restart_in_one_short_line():
    from enhancer.stream_command import notice_line

    state = {"type": "state", "state": "A" * 4_000_000, "input_samples": 151680, "output_samples": 144480}
    line = notice_line(state)
    assert line.startswith("state: the service restarts") and "3000000 bytes" in line and "151680" in line
    assert len(line) < 200
    assert notice_line({"type": "end", "samples": 5, "reason": "shutdown", "message": "reconnect"}) == "end: reconnect"
    assert notice_line({"type": "late", "lateness_ms": 41.8}) == "late: lateness_ms 41.8"
    assert notice_line({"type": "end", "samples": 5}) is None and notice_line({"type": "ready"}) is None
