"""Faults: clients that vanish mid-frame, stall, send too fast or reconnect in a loop; a failing
inference step; SIGTERM during active streams; a missing or corrupt model at start."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from websockets.asyncio.client import connect as aconnect
from websockets.exceptions import ConnectionClosed

from tests.conftest import speechlike
from tests.tolerance import assert_close_to_peak
from tools.rawws import OP_BINARY, OP_TEXT, RawClient

from .conftest import TEST_LIMITS, LiveServer
from .test_ws import from_bytes, stream_through, to_bytes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def live_fault(model_path):
    """Short idle timeout and a small input buffer, so stalls and backpressure show within seconds.
    Room for twice the 8 clients of the reconnect loop: a client that reconnects at once may find its
    previous stream not yet released (the order of two sockets' events is the event loop's)."""
    srv = LiveServer(model=model_path, **(TEST_LIMITS | dict(idle_timeout_s=1.5, max_buffered_s=0.5, max_streams=16)))
    yield srv
    srv.stop()


def internal_errors(srv) -> float:
    return srv.metrics.errors.labels(kind="internal")._value.get()


def wait_until(predicate, timeout: float, step: float = 0.05) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def open_raw(srv, start: dict | None = None, **kw) -> RawClient:
    c = RawClient.connect("127.0.0.1", srv.port, "/v1/stream", **kw)
    c.send_text(json.dumps(start or {"sample_rate": 16000, "encoding": "pcm_s16le"}))
    op, payload = c.recv_frame()
    assert op == OP_TEXT and json.loads(payload)["type"] == "ready", payload
    return c


def assert_serves(srv, enhancer_rt, seed: int = 5) -> None:
    x = speechlike(8000, 16000, seed=seed)[:, None]
    y, _, code = stream_through(srv.ws_url, x, 16000, "f32le", [3000, 5000])
    assert code == 1000
    assert_close_to_peak(y[:, 0], enhancer_rt.enhance(x[:, 0], 16000))


# ---------------------------------------------------------------------------------- clients
def test_disconnect_mid_frame(live_fault, enhancer_rt):
    """Clients that drop the connection inside a frame (header only, half a payload, a cut close
    frame; with RST or FIN): the server frees each stream and keeps serving; nothing is internal."""
    srv = live_fault
    internal0, opened0 = internal_errors(srv), srv.scheduler.opened
    audio = to_bytes(speechlike(3200, 16000, seed=3), "pcm_s16le")
    cuts = [1, 2, 5, 100, len(audio) // 2]  # bytes of the frame that get out: header bits, mask, payload
    for i in range(40):
        c = open_raw(srv)
        c.send_binary(audio)
        if i % 4 == 3:
            c.send_frame(OP_TEXT, b'{"type": "end"}', cut=cuts[i % len(cuts)])
        else:
            c.send_frame(OP_BINARY, audio, cut=cuts[i % len(cuts)])
        c.abort() if i % 2 else c.close()
    srv.wait_idle()
    assert srv.scheduler.opened - opened0 == 40
    assert internal_errors(srv) == internal0
    assert not srv.server.server_state.connections or wait_until(lambda: not srv.server.server_state.connections, 5)
    assert_serves(srv, enhancer_rt)


def test_stalled_reader_is_bounded_and_dropped(live_fault, enhancer_rt):
    """A client that sends fast but never reads: the server stops reading its audio once
    `max_buffered_s` is queued (bounded memory), and once its output has not drained for
    `idle_timeout_s` the connection is dropped and the stream's slot and lanes are freed."""
    srv = live_fault
    streams0 = srv.scheduler.streams
    c = open_raw(srv, {"sample_rate": 48000, "encoding": "f32le", "channels": 2}, rcvbuf=4096)
    c.sock.settimeout(0.5)
    chunk = np.zeros((4800, 2), "<f4")  # 0.1 s
    chunk[:, 0] = speechlike(4800, 48000, seed=4)
    t0 = time.time()
    max_buffered = 0
    session = None
    blocked = False
    while time.time() - t0 < 30:
        try:
            c.send_binary(chunk.tobytes())
        except (TimeoutError, OSError):
            blocked = True  # the server stopped reading: backpressure reached the client
            break
        session = session or next(iter(srv.app.state.sessions), None)
        if session is not None:
            max_buffered = max(max_buffered, session.buffered)
    assert blocked, "the server kept reading audio from a client that never reads"
    cap = srv.settings.max_buffered_s * 48000 + 4800  # the cap plus the message that crossed it
    assert max_buffered <= cap, (max_buffered, cap)
    t_stall = time.time()
    assert wait_until(lambda: srv.scheduler.streams == streams0, srv.settings.idle_timeout_s + 8), \
        "the stalled stream was never dropped"
    assert time.time() - t_stall < srv.settings.idle_timeout_s + 8
    c.abort()
    srv.wait_idle()
    assert wait_until(lambda: not srv.server.server_state.connections, 5)
    assert_serves(srv, enhancer_rt)


def test_faster_than_real_time_sender(live_fault, enhancer_rt):
    """One client pushes 10 s of audio as fast as it can while three others stream at real-time
    pace: the fast one is held to `max_buffered_s` of queued input and gets all of its output;
    the paced ones get theirs, exact, with no stall longer than a few hops."""
    srv = live_fault
    sr = 16000
    fast_x = speechlike(10 * sr, sr, seed=30)[:, None]
    paced = [speechlike(2 * sr, sr, seed=31 + i)[:, None] for i in range(3)]
    peak = {"buffered": 0}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            for s in list(srv.app.state.sessions):
                peak["buffered"] = max(peak["buffered"], s.buffered)
            time.sleep(0.002)

    async def client(x, pace: float, chunk: int):
        out, gaps = [], []
        async with aconnect(srv.ws_url, max_size=None) as ws:
            await ws.send(json.dumps({"sample_rate": sr, "encoding": "f32le"}))
            assert json.loads(await ws.recv())["type"] == "ready"

            async def reader():
                last = None
                async for m in ws:
                    if isinstance(m, bytes):
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                        out.append(from_bytes(m, "f32le", 1))

            task = asyncio.create_task(reader())
            for i in range(0, len(x), chunk):
                await ws.send(to_bytes(x[i:i + chunk], "f32le"))
                await asyncio.sleep(pace)
            await ws.send(json.dumps({"type": "end"}))
            await task
            assert ws.close_code == 1000
        return np.concatenate(out), gaps

    async def run():
        return await asyncio.gather(client(fast_x, 0.0, 8000), *(client(x, 0.02, 320) for x in paced))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        results = asyncio.run(run())
    finally:
        stop.set()
        watcher.join()
    cap = srv.settings.max_buffered_s * sr + 8000
    assert 0 < peak["buffered"] <= cap, (peak, cap)
    for x, (y, _gaps) in zip([fast_x] + paced, results):
        assert y.shape == x.shape
        assert_close_to_peak(y[:, 0], enhancer_rt.enhance(x[:, 0], sr))
    srv.wait_idle()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_reconnect_loop_1000_cycles(live_fault, enhancer_rt):
    """1,000 connect / start / audio / disconnect cycles (clean close, end message, RST, or gone
    before the start message): no stream, lane, task, connection, descriptor or memory left behind."""
    srv = live_fault
    audio = to_bytes(speechlike(1600, 16000, seed=6), "pcm_s16le")

    def cycle(i):
        c = RawClient.connect("127.0.0.1", srv.port, "/v1/stream")
        kind = i % 4
        if kind == 3:  # gone before the start message
            c.abort()
            return
        c.send_text('{"sample_rate": 16000}')
        c.recv_frame()
        c.send_binary(audio)
        if kind == 0:
            c.send_text('{"type": "end"}')
            c.recv_until_close()
            c.close()
        elif kind == 1:
            c.send_close(1000)
            c.recv_until_close()
            c.close()
        else:
            c.abort()

    def tasks():
        return len(srv.server.server_state.tasks)

    from concurrent.futures import ThreadPoolExecutor

    def cycles(n):  # 8 clients at a time
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(cycle, range(n)))

    cycles(100)  # warm-up: caches and allocator reach their working size
    srv.wait_idle()
    assert wait_until(lambda: not srv.server.server_state.connections and tasks() == 0, 10)
    fds0, rss0, opened0 = _fds(), _rss_mb(), srv.scheduler.opened
    cycles(1000)
    srv.wait_idle()
    assert wait_until(lambda: not srv.server.server_state.connections and tasks() == 0, 10)
    assert srv.scheduler.opened - opened0 == 750
    assert not srv.app.state.sessions
    assert _fds() - fds0 <= 2, f"{_fds() - fds0} descriptors left after 1000 cycles"
    grown = _rss_mb() - rss0
    assert grown < 25, f"memory grew by {grown:.0f} MB over 1000 cycles"
    assert_serves(srv, enhancer_rt)


# ---------------------------------------------------------------------------------- REST clients
def test_stalled_upload_gets_408(live_fault):
    """A client that sends half its body and then nothing: 408 after the idle timeout, not a
    connection held forever."""
    srv = live_fault
    b = np.zeros(16000, np.int16).tobytes()
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=15)
    s.sendall(b"POST /v1/enhance HTTP/1.1\r\nHost: x\r\nContent-Type: audio/wav\r\n"
              + f"Content-Length: {2 * len(b)}\r\n\r\n".encode() + b)
    t = time.time()
    head = b""
    while b"\r\n\r\n" not in head or not head.endswith(b"}"):
        chunk = s.recv(65536)
        if not chunk:
            break
        head += chunk
    s.close()
    assert head.startswith(b"HTTP/1.1 408"), head[:200]
    assert b"idle_timeout" in head
    assert time.time() - t < srv.settings.idle_timeout_s + 5


def test_upload_client_disconnects_midway(live_fault, enhancer_rt):
    srv = live_fault
    jobs0, internal0 = srv.scheduler.rest_jobs, internal_errors(srv)
    for cut in (10, 5000):
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(b"POST /v1/enhance HTTP/1.1\r\nHost: x\r\nContent-Type: audio/wav\r\nContent-Length: 100000\r\n\r\n"
                  + bytes(cut))
        s.close()
    assert wait_until(lambda: not srv.server.server_state.connections, 5)
    assert srv.scheduler.rest_jobs == jobs0
    assert internal_errors(srv) == internal0
    assert_serves(srv, enhancer_rt)


def test_download_never_read_is_dropped(live_fault):
    """A REST client that uploads and then never reads the (large) answer: once nothing has
    drained for `idle_timeout_s` the connection is dropped (no connection or spooled file kept)."""
    import io

    srv = live_fault
    stalled0 = srv.metrics.stalled._value.get()
    b = io.BytesIO()
    sf.write(b, np.zeros((96000 * 12, 2), np.float32), 96000, format="FLAC", subtype="PCM_24")  # silence: tiny
    body = b.getvalue()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", srv.port))
    s.sendall(b"POST /v1/enhance?format=wav HTTP/1.1\r\nHost: x\r\nContent-Type: audio/flac\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # 4.6 MB of WAV to come back
    try:
        assert wait_until(lambda: srv.metrics.stalled._value.get() > stalled0, 60), "the stalled download was kept"
        assert wait_until(lambda: not srv.server.server_state.connections, 5)
        assert srv.scheduler.rest_jobs == 0
    finally:
        s.close()


# ---------------------------------------------------------------------------------- inference faults
async def collect(ws, out: list, texts: list) -> None:
    """Read a websocket until it closes: f32le audio into `out`, JSON messages into `texts`."""
    try:
        async for m in ws:
            if isinstance(m, bytes):
                out.append(from_bytes(m, "f32le", 1))
            else:
                texts.append(json.loads(m))
    except ConnectionClosed:
        pass


def _lanes_of(srv, job_id: int) -> set[int]:
    for w in srv.scheduler.workers:
        job = w.jobs.get(job_id)
        if job is not None:
            return {int(x) for x in job.cursor.lanes}
    return set()


def test_inference_failure_mid_batch_closes_only_the_affected_stream(live_fault, enhancer_rt, monkeypatch):
    """Every call of the lane pool that includes stream A's lane raises (a live step is a one-frame
    `run`). A gets 1011 (internal); B and C, which were batched with A, are retried without it and
    finish with exact output."""
    srv = live_fault
    sr = 16000
    signals = [speechlike(sr, sr, seed=40 + i)[:, None] for i in range(3)]
    poisoned: set[int] = set()
    failed_batches = []
    worker = srv.scheduler.workers[0]
    original = worker.pool.run

    def run(lanes, hops, gains):
        if poisoned & {int(x) for x in lanes}:
            failed_batches.append(len(lanes))
            raise RuntimeError("injected: onnxruntime failed on this batch")
        return original(lanes, hops, gains)

    monkeypatch.setattr(worker.pool, "run", run)

    async def client(i, x, opened: asyncio.Event, go: asyncio.Event):
        out, texts = [], []
        async with aconnect(srv.ws_url, max_size=None) as ws:
            before = set(srv.scheduler.jobs)
            await ws.send(json.dumps({"sample_rate": sr, "encoding": "f32le"}))
            assert json.loads(await ws.recv())["type"] == "ready"
            if i == 0:
                (job_id,) = set(srv.scheduler.jobs) - before
                while not _lanes_of(srv, job_id):
                    await asyncio.sleep(0.01)
                poisoned.update(_lanes_of(srv, job_id))
            opened.set()
            await go.wait()

            task = asyncio.create_task(collect(ws, out, texts))
            for k in range(0, len(x), 4000):
                await ws.send(to_bytes(x[k:k + 4000], "f32le"))
            await ws.send(json.dumps({"type": "end"}))
            await task
            code = ws.close_code
        y = np.concatenate(out) if out else np.zeros((0, 1), np.float32)
        return y, texts, code

    async def run():
        events = [asyncio.Event() for _ in signals]
        go = asyncio.Event()
        tasks = []
        for i, x in enumerate(signals):  # A first: its lanes are known before B and C open
            tasks.append(asyncio.create_task(client(i, x, events[i], go)))
            await events[i].wait()
        go.set()
        return await asyncio.gather(*tasks)

    internal0 = internal_errors(srv)
    (_ya, ta, ca), *others = asyncio.run(run())
    assert ca == 1011 and ta[-1]["kind"] == "internal" and ta[-1]["code"] == 1011, (ca, ta[-3:])
    assert max(failed_batches) > 1, "the injected failure never hit a batch shared with other streams"
    for x, (y, texts, code) in zip(signals[1:], others):
        assert code == 1000, (code, texts[-2:])
        assert texts[-1] == {"type": "end", "samples": len(x)}
        assert_close_to_peak(y[:, 0], enhancer_rt.enhance(x[:, 0], sr))
    assert internal_errors(srv) - internal0 == 1
    monkeypatch.undo()
    srv.wait_idle()


def test_transient_step_failure_costs_no_stream(live_fault, enhancer_rt, monkeypatch):
    """A batched step that fails once (e.g. a transient allocation failure) is retried stream by
    stream: every stream finishes normally."""
    srv = live_fault
    worker = srv.scheduler.workers[0]
    original = worker.pool.run  # a live step is a one-frame run
    calls = {"n": 0}

    def flaky(lanes, hops, gains):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected: transient failure")
        return original(lanes, hops, gains)

    monkeypatch.setattr(worker.pool, "run", flaky)
    x = speechlike(16000, 16000, seed=44)[:, None]
    y, texts, code = stream_through(srv.ws_url, x, 16000, "f32le", [2000] * 8)
    assert calls["n"] > 5 and code == 1000, (calls, texts[-2:])
    assert_close_to_peak(y[:, 0], enhancer_rt.enhance(x[:, 0], 16000))
    monkeypatch.undo()
    srv.wait_idle()


# ---------------------------------------------------------------------------------- process faults
def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _serve(model, port, *extra, env=None) -> subprocess.Popen:
    code = ("import sys, server; server.run(host='127.0.0.1', port=int(sys.argv[1]), model=sys.argv[2], "
            "device='cpu', max_streams=8, capacity=8, lateness_budget_ms=30000.0, max_lateness_ms=60000.0, "
            "drain_timeout_s=3.0, max_batch_wait_ms=2.0)")  # fixed capacity, no skipping: exact tails on a busy machine
    return subprocess.Popen([sys.executable, "-c", code, str(port), str(model), *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_ready(proc, port: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("server did not become ready")


def test_sigterm_drains_active_streams(model_path, enhancer_rt):
    """SIGTERM while four streams are open (all audio sent, no end message) and a REST request
    is in flight: the streams run on for the drain timeout (3 s), then each gets the enhanced tail
    of everything it sent, {"type": "end", "samples": n, "reason": "shutdown", "message": ...} and
    close 1012; the REST request completes; the process ends by the signal it was sent, after the
    drain (uvicorn re-raises it), and only then stops answering. tests/server/test_drain.py covers
    /readyz, /healthz, the agent and new connections during the drain."""
    port = _free_port()
    proc = _serve(model_path, port)
    try:
        _wait_ready(proc, port)
        url = f"ws://127.0.0.1:{port}/v1/stream"
        sr = 16000
        signals = [speechlike(int(1.5 * sr), sr, seed=50 + i)[:, None] for i in range(4)]
        wav = speechlike(8 * sr, sr, seed=60)

        async def client(x, sent: asyncio.Event):
            out, texts = [], []
            async with aconnect(url, max_size=None) as ws:
                await ws.send(json.dumps({"sample_rate": sr, "encoding": "f32le"}))
                assert json.loads(await ws.recv())["type"] == "ready"

                task = asyncio.create_task(collect(ws, out, texts))
                for k in range(0, len(x), 1600):
                    await ws.send(to_bytes(x[k:k + 1600], "f32le"))
                sent.set()
                await task
                code = ws.close_code
            return np.concatenate(out), texts, code

        def rest():
            import io

            b = io.BytesIO()
            sf.write(b, wav, sr, format="WAV", subtype="FLOAT")
            return httpx.post(f"http://127.0.0.1:{port}/v1/enhance", content=b.getvalue(),
                              headers={"Content-Type": "audio/wav"}, timeout=60)

        async def run():
            events = [asyncio.Event() for _ in signals]
            tasks = [asyncio.create_task(client(x, e)) for x, e in zip(signals, events)]
            for e in events:
                await e.wait()
            rest_task = asyncio.create_task(asyncio.to_thread(rest))
            await asyncio.sleep(0.5)  # the server has read the audio and the upload has started
            t = time.time()
            proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks)
            return results, await rest_task, time.time() - t

        results, response, took = asyncio.run(run())
        for x, (y, texts, code) in zip(signals, results):
            assert code == 1012, (code, texts[-2:])
            end = texts[-1]
            assert (end["type"], end["samples"], end["reason"]) == ("end", len(x), "shutdown"), texts[-2:]
            assert f"from sample {len(x)}" in end["message"] and "reconnect" in end["message"], end
            assert y.shape == x.shape
            assert_close_to_peak(y[:, 0], enhancer_rt.enhance(x[:, 0], sr))
        assert response.status_code == 200, response.text[:300]
        out, out_sr = sf.read(__import__("io").BytesIO(response.content), dtype="float32")
        assert out.shape == wav.shape and out_sr == sr
        assert 3 <= took < 8, took  # the streams ran on for the drain timeout, then got their tails
        assert proc.wait(timeout=20) == -signal.SIGTERM, proc.stderr.read().decode()[-2000:]
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _enhancer_serve(*args, env=None) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("enhancer")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "enhancer"]
    return subprocess.run([*cmd, "serve", "--port", str(_free_port()), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)


def _assert_clean_failure(r: subprocess.CompletedProcess, *words: str) -> None:
    """Non-zero exit, no traceback, and an `error: ...` message naming the problem."""
    assert r.returncode != 0, r.stdout[-1000:]
    err = r.stderr.strip()
    assert "Traceback" not in err, err[-3000:]
    assert "error: " in err, err[-2000:]
    message = err[err.index("error: "):]
    for w in words:
        assert w.lower() in message.lower(), message


def test_missing_model_at_start(tmp_path):
    _assert_clean_failure(_enhancer_serve("--model", str(tmp_path / "nope.onnx")), "model file not found", "nope.onnx")
    _assert_clean_failure(_enhancer_serve("--model", str(tmp_path)), "model file not found")  # a directory
    env = os.environ | {"TIM_ENHANCER_MODEL": str(tmp_path / "gone.onnx")}
    _assert_clean_failure(_enhancer_serve(env=env), "gone.onnx")


def test_corrupt_model_at_start(tmp_path, model_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(os.urandom(4096))
    _assert_clean_failure(_enhancer_serve("--model", str(junk)), "cannot load model", "junk.onnx")
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    _assert_clean_failure(_enhancer_serve("--model", str(empty)), "empty.onnx")
    cut = tmp_path / "truncated.onnx"
    cut.write_bytes(Path(model_path).read_bytes()[:100_000])
    _assert_clean_failure(_enhancer_serve("--model", str(cut)), "truncated.onnx")
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    other = tmp_path / "other.onnx"
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)]), other)
    _assert_clean_failure(_enhancer_serve("--model", str(other)), "not a tim-enhancer step graph")


def test_unavailable_device_at_start(model_path):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has CUDA")
    _assert_clean_failure(_enhancer_serve("--model", str(model_path), "--device", "cuda"), "CUDAExecutionProvider")


def test_port_in_use_at_start(model_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        exe = Path(sys.executable).with_name("enhancer")
        r = subprocess.run([str(exe), "serve", "--port", str(port), "--model", str(model_path), "--device", "cpu"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    finally:
        s.close()
    _assert_clean_failure(r, "address already in use", str(port), f"--port {port + 1}", f"make serve PORT={port + 1}")
