"""Capacity, admission and lateness: refusal at capacity (1013 / 503 with the JSON error), the
capacity in /readyz and /metrics, calibration on a fake step, and the catch-up policy with a
deliberately slow step (a stream that falls behind is told so and skips its backlog, marked as a gap)."""
from __future__ import annotations

import asyncio
import io
import json
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import soundfile as sf
from websockets.asyncio.client import connect as aconnect
from websockets.sync.client import connect

from server import capacity as calibration
from server.metrics import Metrics
from server.settings import Settings
from server.commands import Open, Push
from server.streams import StreamState
from server.worker import Worker
from tests.conftest import speechlike
from tests.tolerance import assert_close_to_peak

from .conftest import TEST_LIMITS, LiveServer
from .test_ws import astream_through, expect_close, from_bytes, to_bytes

HOP_S = 0.016


def metric(srv, name: str) -> float:
    for line in httpx.get(srv.base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def live_cap(model_path):
    """Capacity fixed at 2 live streams (max_streams 8 would allow more)."""
    srv = LiveServer(model=model_path, **(TEST_LIMITS | dict(max_streams=8, capacity=2, max_rest_jobs=2)))
    yield srv
    srv.stop()


# ---------------------------------------------------------------------------------- admission
def test_capacity_and_live_count_in_readyz_and_metrics(live_cap):
    r = httpx.get(live_cap.base + "/readyz", timeout=10).json()
    cap = r["capacity"]
    assert cap["streams"] == 2 and cap["calibrated"] is False and cap["per_worker"] == [2]
    assert cap["active_streams"] == 0 and cap["free"] == 2
    assert metric(live_cap, "tim_capacity_streams") == 2
    assert metric(live_cap, "tim_capacity_calibrated") == 0
    assert metric(live_cap, 'tim_capacity_worker_streams{worker="0"}') == 2
    text = httpx.get(live_cap.base + "/metrics", timeout=10).text
    for name in ("tim_stream_lateness_seconds_bucket", "tim_stream_lateness_worst_seconds", "tim_late_hops_total", "tim_streams_behind_total",
                 "tim_skipped_hops_total", "tim_gaps_total", 'tim_refused_total{source="stream"}'):
        assert name in text, name


def test_stream_beyond_capacity_is_refused_with_1013_and_the_capacity(live_cap):
    refused0 = metric(live_cap, 'tim_refused_total{source="stream"}')
    with connect(live_cap.ws_url) as a, connect(live_cap.ws_url) as b:
        for ws in (a, b):
            ws.send(json.dumps({"sample_rate": 16000}))
            assert json.loads(ws.recv(timeout=10))["type"] == "ready"
        r = httpx.get(live_cap.base + "/readyz", timeout=10).json()
        assert r["active_streams"] == 2 and r["capacity"]["free"] == 0
        assert metric(live_cap, "tim_active_streams") == 2
        # the third: at the handshake (no start message sent) and after a start message
        for start in (False, True):
            with connect(live_cap.ws_url) as c:
                if start:
                    try:
                        c.send(json.dumps({"sample_rate": 16000}))
                    except Exception:  # noqa: BLE001 - the refusal may already have closed the socket
                        pass
                err = json.loads(c.recv(timeout=10))
                with pytest.raises(Exception):
                    c.recv(timeout=10)
                assert c.close_code == 1013
            assert err["type"] == "error" and err["kind"] == "over_capacity" and err["code"] == 1013, err
            assert err["capacity"] == 2 and err["active_streams"] == 2 and err["retry_after_s"] > 0, err
            assert "2 live stream" in err["message"] and "retry" in err["message"], err
    assert metric(live_cap, 'tim_refused_total{source="stream"}') == refused0 + 2
    live_cap.wait_idle()
    expect_close(live_cap.ws_url, [json.dumps({"type": "end"})], 1000)  # room again once they left


def test_stereo_stream_counts_two_of_the_capacity(live_cap):
    with connect(live_cap.ws_url) as a:
        a.send(json.dumps({"sample_rate": 16000}))
        assert json.loads(a.recv(timeout=10))["type"] == "ready"
        with connect(live_cap.ws_url) as b:  # one place left: a stereo stream does not fit
            b.send(json.dumps({"sample_rate": 16000, "channels": 2}))
            err = json.loads(b.recv(timeout=10))
            assert err["kind"] == "over_capacity" and err["code"] == 1013 and err["capacity"] == 2, err
            assert "room for 1 channel" in err["message"], err
        with connect(live_cap.ws_url) as c:  # a mono one does
            c.send(json.dumps({"sample_rate": 16000}))
            assert json.loads(c.recv(timeout=10))["type"] == "ready"
    live_cap.wait_idle()


def test_open_refuses_at_the_start_message_when_capacity_is_taken_meanwhile(live_cap):
    """The handshake passed (room left), then another stream took the last place: the start
    message gets 1013."""
    sched = live_cap.scheduler
    with connect(live_cap.ws_url) as a:
        a.send(json.dumps({"sample_rate": 16000}))
        assert json.loads(a.recv(timeout=10))["type"] == "ready"
        with connect(live_cap.ws_url) as b:  # handshake accepted: one place left
            with connect(live_cap.ws_url) as c:
                c.send(json.dumps({"sample_rate": 16000}))
                assert json.loads(c.recv(timeout=10))["type"] == "ready"
                assert sched.admission.live_full
                b.send(json.dumps({"sample_rate": 16000}))
                err = json.loads(b.recv(timeout=10))
                assert err["kind"] == "over_capacity" and err["capacity"] == 2, err
    live_cap.wait_idle()


def test_rest_gets_503_with_retry_after_while_live_streams_hold_the_capacity(live_cap):
    b = io.BytesIO()
    sf.write(b, speechlike(4000, 16000, seed=2), 16000, format="WAV")
    h = {"Content-Type": "audio/wav"}
    with connect(live_cap.ws_url) as s1, connect(live_cap.ws_url) as s2:
        for ws in (s1, s2):
            ws.send(json.dumps({"sample_rate": 16000}))
            assert json.loads(ws.recv(timeout=10))["type"] == "ready"
        r = httpx.post(live_cap.base + "/v1/enhance", content=b.getvalue(), headers=h, timeout=60)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        err = r.json()["error"]
        assert err["kind"] == "over_capacity" and err["capacity"] == 2 and err["retry_after_s"] >= 1, err
    live_cap.wait_idle()
    r = httpx.post(live_cap.base + "/v1/enhance", content=b.getvalue(), headers=h, timeout=60)
    assert r.status_code == 200


def test_files_only_use_the_lanes_and_time_live_streams_leave(enhancer_rt):
    """A worker's files ride beside its live streams within its capacity, and step on their own
    only within the duty cycle while live streams are served."""
    s = Settings.build(capacity_margin=0.5)
    live = {"lanes": 0}
    w = Worker(0, enhancer_rt, 16, Metrics(), settings=s, service_live=lambda: live["lanes"])
    w.ledger.capacity = 4
    files = [SimpleNamespace(channels=c) for c in (2, 1, 2)]
    now = time.perf_counter()
    assert w.files.allowed(files, False, now)[0] == files  # no live stream anywhere: no limit
    w.ledger.live = live["lanes"] = 2
    assert w.files.allowed(files, True, now)[0] == files[:1]  # 2 lanes left: the 2-channel file only
    w.ledger.live = live["lanes"] = 4
    assert w.files.allowed(files, True, now)[0] == []  # live streams hold the capacity: files wait
    w.ledger.live, live["lanes"] = 0, 3  # live streams on another worker: a duty cycle
    w.files.credit, w.files.credit_t = -0.004, now
    allowed, wait = w.files.allowed(files, False, now)
    assert allowed == [] and wait == pytest.approx(0.008, rel=0.01)
    assert w.files.allowed(files, False, now + 0.009)[0] == files


# ---------------------------------------------------------------------------------- calibration
def test_lanes_within_interpolates_and_ignores_noisy_dips():
    assert calibration.lanes_within({1: 2.0, 2: 3.0, 4: 5.0, 8: 9.0, 16: 17.0}, 9.6) == 8
    assert calibration.lanes_within({1: 2.0, 8: 6.0, 16: 14.0}, 10.0) == 12  # halfway between 8 and 16
    assert calibration.lanes_within({1: 2.0, 2: 12.0, 4: 3.0}, 9.6) == 1  # a dip after a spike does not count
    assert calibration.lanes_within({1: 11.0}, 9.6) == 0
    assert calibration.lanes_within({1: 1.0, 2: 1.5}, 9.6) == 2  # all within: what was measured


def test_fixed_capacity_is_capped_by_max_streams_and_spread_over_workers():
    cap = calibration.fixed(10, 2, 64, HOP_S, 0.4)
    assert cap.streams == 10 and cap.per_worker == (5, 5) and not cap.calibrated
    assert calibration.fixed(100, 3, 8, HOP_S, 0.4).per_worker == (3, 3, 2)


class FakePool:
    """A lane pool whose step takes 1 ms + 1 ms per lane (a slow model on a slow machine)."""

    capacity = 64

    def __init__(self):
        self.engine = SimpleNamespace(config=SimpleNamespace(stft=SimpleNamespace(hop=256)))
        self.batches = []

    def step(self, lanes, hops, gains):
        self.batches.append(len(lanes))
        time.sleep(0.001 * (1 + len(lanes)))

    def reset(self, lanes):
        pass


def test_calibration_times_each_worker_and_stays_within_the_budget():
    pools = [FakePool(), FakePool()]
    cap = calibration.calibrate(pools, HOP_S, 0.4, max_streams=64, reps=4)
    budget_ms = 1000 * HOP_S * 0.6  # 9.6 ms: the fake step fits at most 8 lanes
    assert cap.calibrated and cap.budget_ms == pytest.approx(budget_ms)
    assert len(cap.per_worker) == 2 and all(0 <= n <= 8 for n in cap.per_worker)
    assert cap.streams == max(sum(cap.per_worker), 1)
    for pool, p99 in zip(pools, cap.step_p99_ms):
        assert pool.batches and 1 in p99  # each worker timed its own steps, from batch 1 up
        assert max(pool.batches) <= 16  # stopped at the first size over the budget
    assert calibration.calibrate([FakePool()], HOP_S, 0.4, max_streams=3, reps=2).streams <= 3


def test_server_calibrates_at_start_up_before_it_is_ready(model_path):
    srv = LiveServer(model=model_path, **(TEST_LIMITS | dict(capacity=None, max_streams=4)))
    try:
        cap = httpx.get(srv.base + "/readyz", timeout=10).json()["capacity"]
        assert cap["calibrated"] is True and 1 <= cap["streams"] <= 4 and cap["step_p99_ms"][0]["1"] > 0
        assert cap["calibration_s"] < 10
        assert metric(srv, "tim_capacity_calibrated") == 1 and metric(srv, "tim_capacity_streams") == cap["streams"]
    finally:
        srv.stop()


def test_settings_validate_capacity_and_lateness():
    with pytest.raises(ValueError, match="capacity"):
        Settings.build(capacity=0)
    with pytest.raises(ValueError, match="capacity_margin"):
        Settings.build(capacity_margin=1.0)
    with pytest.raises(ValueError, match="max_lateness_ms"):
        Settings.build(lateness_budget_ms=100, max_lateness_ms=50)
    assert Settings.build().capacity is None  # measured by default


# ---------------------------------------------------------------------------------- lateness
def test_lateness_notices_behind_then_on_time(enhancer_rt):
    w = Worker(0, enhancer_rt, 4, Metrics(), settings=Settings.build(lateness_budget_ms=40, max_lateness_ms=200))
    job = SimpleNamespace(source="stream", id=1, channels=1, sample_rate=16000)
    st = StreamState(job, SimpleNamespace(channels=1, min_gain=0.0))
    st.due = 10.0
    w.lateness.observe(st, 10.010)
    assert st.events == []
    w.lateness.observe(st, 10.050)
    w.lateness.observe(st, 10.090)  # told once per episode
    assert [e.type for e in st.events] == ["late"] and st.events[0].budget_ms == 40.0
    w.lateness.observe(st, 10.030)  # under the budget but not yet under half of it
    w.lateness.observe(st, 10.010)
    assert [e.type for e in st.events] == ["late", "on_time"]


def test_due_time_ignores_clients_faster_than_real_time():
    job = SimpleNamespace(source="stream", id=1)
    st = StreamState(job, SimpleNamespace(channels=1, min_gain=0.0))
    st.arrivals.note_push(100, 5.0)  # 1.6 s of audio at once: hop h is due h hops after the first arrival
    assert st.arrivals.due_time(0, HOP_S) == 5.0 and st.arrivals.due_time(50, HOP_S) == pytest.approx(5.8)
    st.arrivals.note_push(1, 20.0)  # after a pause: due when it arrived
    assert st.arrivals.due_time(100, HOP_S) == 20.0


def stream_in_real_time(srv, x, sr: int, chunk: int):
    """Stream `x` (n, 1) at real-time pace in `chunk`-sample messages: (output, JSON messages);
    the stream ends normally with every sample."""
    chunks = [min(chunk, len(x) - i) for i in range(0, len(x), chunk)]
    y, texts, code = asyncio.run(astream_through(srv.ws_url, x, sr, chunks, 0.0, realtime=True))
    assert code == 1000 and texts[-1] == {"type": "end", "samples": len(x)}, texts[-3:]
    return y, texts


@pytest.fixture(params=[120.0], ids=["skip-at-120ms"])
def live_slow(model_path, request):
    """A server with a 40 ms lateness budget that skips backlogs older than `request.param` ms."""
    srv = LiveServer(model=model_path, **(TEST_LIMITS | dict(capacity=4, lateness_budget_ms=40.0,
                                                            max_lateness_ms=request.param)))
    yield srv
    srv.stop()


def test_slow_step_stream_is_told_and_skips_its_backlog_with_the_gap_marked(live_slow, enhancer_rt, monkeypatch):
    """Every hop takes 40 ms (2.5 hops) to compute, in one-hop steps and in multi-frame calls
    alike, while the client streams at real-time pace: the stream falls behind, is told ("late"),
    and instead of falling further behind skips its backlog ("gap": the output samples that are
    zeros / not its enhanced input). The output keeps its length and alignment, audio before the
    first gap equals offline enhancement, the gap's skipped part is silence, and the server keeps
    serving at full speed afterwards."""
    srv = live_slow
    pool = srv.scheduler.workers[0].pool
    real_step, real_run = pool.step, pool.run

    def slow_step(*a, **kw):
        time.sleep(0.040)
        return real_step(*a, **kw)

    def slow_run(lanes, hops, min_gain):
        time.sleep(0.040 * hops.shape[1])
        return real_run(lanes, hops, min_gain)

    sr, seconds, chunk = 16000, 2.0, 320
    x = speechlike(int(seconds * sr), sr, seed=21)[:, None]
    skipped0 = metric(srv, "tim_skipped_hops_total")

    monkeypatch.setattr(pool, "step", slow_step)
    monkeypatch.setattr(pool, "run", slow_run)
    y, texts = stream_in_real_time(srv, x, sr, chunk)
    monkeypatch.undo()
    assert y.shape == x.shape  # sample alignment kept through the skips
    late = [t for t in texts if t["type"] == "late"]
    gaps = [t for t in texts if t["type"] == "gap"]
    assert late and late[0]["lateness_ms"] > 40 and late[0]["budget_ms"] == 40.0, texts
    assert gaps, texts
    for g in gaps:
        assert g["samples"] > 0 and g["skipped_ms"] >= 16 and g["lateness_ms"] >= 120, g  # over the 120 ms threshold, rounded to 0.1 ms
        zeros = int(round(g["skipped_ms"] * sr / 1000))
        seg = y[g["start_sample"]:g["start_sample"] + zeros, 0]
        assert len(seg) == min(zeros, len(y) - g["start_sample"]) and not seg.any(), g  # skipped hops: silence
    ref = enhancer_rt.enhance(x[:, 0], sr)
    first = gaps[0]["start_sample"]
    assert_close_to_peak(y[:first, 0], ref[:first])  # equal to offline enhancement before the first gap
    skipped = metric(srv, "tim_skipped_hops_total") - skipped0
    assert skipped == round(sum(g["skipped_ms"] for g in gaps) / 16)
    assert metric(srv, "tim_streams_behind_total") >= 1 and metric(srv, "tim_gaps_total") == len(gaps)
    srv.wait_idle()
    y2, texts2, code2 = asyncio.run(_stream_at_once(srv.ws_url, x[:8000], sr))  # the server keeps serving
    assert code2 == 1000 and y2.shape == (8000, 1) and texts2[-1] == {"type": "end", "samples": 8000}


def test_backlog_of_a_late_stream_is_one_multi_frame_call_equal_to_hop_by_hop(enhancer_rt, monkeypatch):
    """Twelve hops that arrived 0.5 s ago (late beyond the 40 ms budget, within the 5 s skip
    threshold) run in one call of the lane pool in one round; the same audio on time runs one hop
    per round; both give the same output, and the late stream is told."""
    sr, hop = 16000, 256
    x = speechlike(14 * hop, sr, seed=5)

    def worker_with(arrived):
        w = Worker(0, enhancer_rt, 4, Metrics(), settings=Settings.build(lateness_budget_ms=40, max_lateness_ms=5000))
        job = SimpleNamespace(source="stream", id=1, channels=1, sample_rate=sr, metadata=False)
        w.apply(Open(job, None))
        w.apply(Push(job, x, arrived, 1))
        return w, w.streams[1]

    late_w, late = worker_with(time.perf_counter() - 0.5)
    calls = []
    real_run = late_w.pool.run
    monkeypatch.setattr(late_w.pool, "run", lambda lanes, hops, g: calls.append(hops.shape) or real_run(lanes, hops, g))
    ready = late.cursor.ready_hops()
    assert ready >= 10
    late_w.batcher.round()
    assert calls == [(1, ready, hop)] and late.steps == ready and late.cursor.ready_hops() == 0
    assert [e.type for e in late.events] == ["late"] and late.events[0].lateness_ms >= 400

    now_w, now = worker_with(time.perf_counter() + 100.0)  # due in the future: never late, one hop per round
    for _ in range(ready):
        now_w.batcher.round()
    assert now.steps == ready and not now.events
    assert_close_to_peak(late.cursor.pull(), now.cursor.pull())


@pytest.mark.parametrize("live_slow", [60_000.0], ids=["no-skip"], indirect=True)
def test_a_stream_behind_runs_its_backlog_in_multi_frame_calls(live_slow, enhancer_rt, monkeypatch):
    """Batched one-hop steps take 40 ms (2.5 hops) for 0.6 s, so a real-time stream falls behind
    the 40 ms budget: it is told "late", its backlog runs several hops per call (`Batcher.run_backlog`),
    nothing is skipped (the skip threshold is far), and the output equals offline enhancement."""
    srv = live_slow
    worker = srv.scheduler.workers[0]
    pool = worker.pool
    real_step, real_backlog = pool.step, worker.batcher.run_backlog
    slow_until = []  # batched steps are slow for 0.6 s from the first one, then the machine is fast again
    backlog_hops = []

    def slow_step(*a, **kw):
        if not slow_until:
            slow_until.append(time.perf_counter() + 0.6)
        if time.perf_counter() < slow_until[0]:
            time.sleep(0.040)
        return real_step(*a, **kw)

    def backlog(st):
        before = st.steps
        real_backlog(st)
        backlog_hops.append(st.steps - before)

    sr, seconds, chunk = 16000, 3.0, 256
    x = speechlike(int(seconds * sr), sr, seed=23)[:, None]
    monkeypatch.setattr(pool, "step", slow_step)
    monkeypatch.setattr(worker.batcher, "run_backlog", backlog)
    y, texts = stream_in_real_time(srv, x, sr, chunk)
    monkeypatch.undo()
    kinds = [t["type"] for t in texts]
    assert "gap" not in kinds, texts
    assert "late" in kinds, texts
    assert backlog_hops and max(backlog_hops) > 1, backlog_hops  # several hops in one call
    assert_close_to_peak(y[:, 0], enhancer_rt.enhance(x[:, 0], sr))


async def _stream_at_once(url, x, sr):
    out, texts = [], []
    async with aconnect(url, max_size=None) as ws:
        await ws.send(json.dumps({"sample_rate": sr, "encoding": "f32le"}))
        assert json.loads(await ws.recv())["type"] == "ready"
        await ws.send(to_bytes(x, "f32le"))
        await ws.send(json.dumps({"type": "end"}))
        async for m in ws:
            if isinstance(m, bytes):
                out.append(from_bytes(m, "f32le", 1))
            else:
                texts.append(json.loads(m))
        return np.concatenate(out), texts, ws.close_code


# ---------------------------------------------------------------------------------- operator logs
def test_admission_logs_the_capacity_and_each_refusal(caplog):
    from server.admission import Admission, LaneLedger
    from server.errors import ServiceError
    from server.messages import Source

    adm = Admission(Settings.build(max_streams=4, max_rest_jobs=1), Metrics())
    with caplog.at_level("INFO", logger="tim_enhancer.server"):
        adm.set_capacity(calibration.fixed(1, 1, 4, HOP_S, 0.4), [LaneLedger(size=8, capacity=8, free=8)])
        ledger = adm.ledgers[0]
        assert adm.admit(Source.STREAM, 1) == 0 and ledger.live == 1 and ledger.free == 7
        with pytest.raises(ServiceError) as refused:
            adm.admit(Source.STREAM, 1)
    assert refused.value.close_code == 1013 and refused.value.kind == "over_capacity"
    messages = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert any(m.startswith("capacity: 1 live stream(s) (fixed") for m in messages), messages
    assert any("refused a live stream (1013)" in m for m in messages), messages
    adm.release(ledger, Source.STREAM, 1)
    assert ledger.live == 0 and ledger.free == 8 and adm.streams == 0


def test_server_logs_when_ready_with_the_demo_url(model_path, caplog):
    with caplog.at_level("INFO", logger="tim_enhancer.server"):
        srv = LiveServer(model=model_path, **(TEST_LIMITS | dict(capacity=3)))
    try:
        deadline = time.time() + 5  # logged right after uvicorn's start-up, which the fixture waits for
        while not (ready := [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready:")]):
            if time.time() > deadline:
                break
            time.sleep(0.02)
        assert len(ready) == 1 and f"http://127.0.0.1:{srv.port}/" in ready[0], ready
        assert "CPUExecutionProvider" in ready[0] and "1 worker(s), capacity 3 live stream(s) (fixed)" in ready[0]
    finally:
        srv.stop()
