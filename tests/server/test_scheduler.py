"""The scheduler's parts on their own: typed commands applied by a worker to the jobs it holds
(the same `Job` objects the event loop holds; on the worker, the count of live lanes), the event
loop's ledger of reserved lanes, and the GIL switch interval restored when the last scheduler stops."""
from __future__ import annotations

import asyncio
import sys

import numpy as np
import pytest

from server.messages import Source
from server.metrics import Metrics
from server.scheduling.jobs import Close, End, Job, Open, Push
from server.scheduling.scheduler import SWITCH_INTERVAL_S, Scheduler, SwitchInterval
from server.scheduling.worker import Worker
from server.settings import Settings
from tests.conftest import speechlike


class Loop:
    """Where a worker hands deliveries to (an event loop's call_soon_threadsafe): kept in a list."""

    def __init__(self, posted: list):
        self.posted = posted

    def call_soon_threadsafe(self, fn, batch) -> None:
        self.posted.extend(batch)


def _job(i: int, source: str = "stream", channels: int = 1, posted: list | None = None) -> Job:
    """A job with no event loop of its own: its deliveries go to `posted`."""
    return Job(i, Source(source), 16000, channels, loop=Loop(posted if posted is not None else []))


def test_worker_applies_typed_commands_and_counts_its_live_lanes(enhancer_rt):
    w = Worker(0, enhancer_rt, 8, Metrics())
    live, stereo, rest = _job(1), _job(2, channels=2), _job(3, "rest", 2)
    for job in (live, stereo, rest):
        w.apply(Open(job, None))
    assert set(w.jobs) == {1, 2, 3} and w.live_lanes == 3  # files do not count
    assert w.jobs[1] is live  # the worker holds the event loop's object
    assert w.pool.n_free == 8 - 5
    w.apply(Push(live, speechlike(1000), 12.5, 1))
    assert live.cursor.ready_hops() == 1000 // 256 and live.acked == 1 and live.arrivals.first_arrival == 12.5
    w.apply(End(live, 1))
    assert live.flushing and live.acked == 1
    w.apply(Close(stereo))
    assert set(w.jobs) == {1, 3} and w.live_lanes == 1 and w.pool.n_free == 8 - 3
    w.apply(Close(stereo))  # closed already: nothing happens
    w.apply(Close(live))
    w.apply(Close(rest))
    assert not w.jobs and w.live_lanes == 0 and w.pool.n_free == 8


def test_a_live_job_that_fails_leaves_the_live_count(enhancer_rt):
    w, posted = Worker(0, enhancer_rt, 4, Metrics()), []
    job = _job(1, posted=posted)
    w.apply(Open(job, None))
    w.apply(Push(job, np.full(300, np.nan, np.float32), 0.0, 1))  # invalid audio: the stream fails
    assert not w.jobs and w.live_lanes == 0 and w.pool.n_free == 4
    (failed, delivery), = posted
    assert failed is job and delivery.final and delivery.error.kind == "invalid_audio"


def test_switch_interval_is_lowered_while_schedulers_run_and_restored_after_the_last(monkeypatch):
    # on its own: no scheduler of another test (the session's live server) holds the interval
    monkeypatch.setattr(SwitchInterval, "_holders", 0)
    monkeypatch.setattr(SwitchInterval, "_saved", None)
    outer = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    before = sys.getswitchinterval()
    SwitchInterval.lower()
    SwitchInterval.lower()  # a second scheduler in the same process
    assert sys.getswitchinterval() == pytest.approx(min(before, SWITCH_INTERVAL_S))
    SwitchInterval.restore()
    assert sys.getswitchinterval() == pytest.approx(min(before, SWITCH_INTERVAL_S))  # one still runs
    SwitchInterval.restore()
    assert sys.getswitchinterval() == pytest.approx(before)
    SwitchInterval.restore()  # more restores than lowers: no change
    assert sys.getswitchinterval() == pytest.approx(before)
    sys.setswitchinterval(outer)


def test_scheduler_reserves_lanes_on_the_loop_and_restores_the_switch_interval(model_path):
    before = sys.getswitchinterval()
    s = Scheduler(Settings.build(model=model_path, device="cpu", workers=2, capacity=4, max_streams=4,
                                 max_rest_jobs=1, max_channels=2), Metrics())
    s.start()
    try:
        assert sys.getswitchinterval() == pytest.approx(min(before, SWITCH_INTERVAL_S))
        assert [ledger.capacity for ledger in s.ledgers] == [2, 2]

        async def admit():
            jobs = [s.open(16000, 1), s.open(16000, 2), s.open(16000, 1, source="rest")]
            placed = [(job.worker.index, job.ledger.live, job.ledger.free) for job in jobs]
            for job in jobs:
                job.close()
            return placed

        placed = asyncio.run(admit())
        assert placed[0][0] != placed[1][0]  # the least loaded worker takes the next stream
        total = s.ledgers[0].size
        assert all(ledger.free == total and ledger.live == 0 for ledger in s.ledgers)
    finally:
        s.stop()
    assert sys.getswitchinterval() == pytest.approx(before)


def test_the_event_loop_s_cpu_per_stream_and_hop_is_measured_and_averaged():
    import time

    s = Scheduler(Settings.build(), Metrics())
    s.hop_s = 0.016

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    cpu, wall = time.thread_time(), time.monotonic()
    cpu, wall = s.measure_loop(cpu, wall, 0)  # no stream: nothing to measure
    assert s.loop_ms_per_stream is None
    burn(0.032)
    c0, w0 = cpu, wall
    cpu, wall = s.measure_loop(cpu, wall, 2)
    first = s.loop_ms_per_stream
    # the thread's CPU clock may tick coarsely (a VM, a sandbox): judge against what it reported
    burned, hops = cpu - c0, (wall - w0) / 0.016
    assert burned >= 0.032
    assert first == pytest.approx(1000 * burned / hops / 2, rel=1e-6)  # this thread's CPU, per hop, 2 streams
    assert first >= 1000 * 0.032 / hops / 2
    time.sleep(0.032)  # idle: the next tick measures (almost) nothing, weighed 1 in 5
    c1, w1 = cpu, wall
    cpu, wall = s.measure_loop(cpu, wall, 2)
    idle = 1000 * (cpu - c1) / ((wall - w1) / 0.016) / 2
    assert idle < first
    assert s.loop_ms_per_stream == pytest.approx(0.8 * first + 0.2 * idle, rel=1e-6)
