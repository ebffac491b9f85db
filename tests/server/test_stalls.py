"""Stall instrumentation: the event-loop lag monitor, the garbage-collector timer, the idle observer
process and the attribution of late messages to stalls of the whole machine."""
from __future__ import annotations

import asyncio
import gc
import time

from prometheus_client import CollectorRegistry, Histogram

from server.stalls import GcTimer, LoopLagMonitor
from tools.machine_stalls import MachineStallObserver


def _hist(labels=()):
    return Histogram("h", "h", list(labels), buckets=(0.01, 0.05, 0.1, 1.0), registry=CollectorRegistry())


def _sum_count(h, **labels):
    m = h.labels(**labels) if labels else h
    samples = {s.name: s.value for s in m.collect()[0].samples if s.labels.get("le") is None}
    return samples["h_sum"], samples["h_count"]


def test_loop_lag_monitor_sees_a_blocked_loop():
    h = _hist()

    async def main():
        mon = LoopLagMonitor(h, interval=0.01)
        mon.start()
        await asyncio.sleep(0.05)
        time.sleep(0.15)  # blocks the loop
        await asyncio.sleep(0.05)
        await mon.stop()
        return mon.max_lag

    max_lag = asyncio.run(main())
    total, count = _sum_count(h)
    assert 0.12 <= max_lag < 1.0 and count >= 3 and total >= 0.12


def test_gc_timer_times_older_collections_by_generation_and_uninstalls():
    h = _hist(["generation"])
    timer = GcTimer(h)
    timer.install()
    try:
        gc.collect(2)
        gc.collect(1)
        gc.collect(0)
    finally:
        timer.uninstall()
    assert _sum_count(h, generation="2")[1] >= 1 and _sum_count(h, generation="1")[1] >= 1
    assert "0" not in {s.labels.get("generation") for s in h.collect()[0].samples}  # young ones are not timed
    before = _sum_count(h, generation="2")[1]
    gc.collect(2)
    assert _sum_count(h, generation="2")[1] == before and timer not in gc.callbacks


def test_observer_process_reports_a_stall_of_its_own_process_group():
    obs = MachineStallObserver(interval=0.005, record_s=0.02).start()
    time.sleep(0.3)  # let it start
    import os
    import signal

    os.kill(obs.proc.pid, signal.SIGSTOP)  # what a descheduled virtual CPU looks like to it
    t_stop = time.perf_counter()
    time.sleep(0.12)
    os.kill(obs.proc.pid, signal.SIGCONT)
    time.sleep(0.1)
    events = obs.stop()
    assert any(lag >= 0.1 and t <= t_stop + 0.01 for t, lag in events), events
    assert obs.proc is None


def test_late_messages_are_attributed_to_machine_stalls_only_nearby():
    obs = MachineStallObserver()
    obs.events = [(100.0, 0.2), (200.0, 0.025)]  # a 200 ms stall, and one under the 32 ms threshold
    assert obs.explains(100.1) and obs.explains(101.6)  # during it, and 1.4 s after its end
    assert not obs.explains(99.9) and not obs.explains(101.8)  # before it, and past the recovery window
    assert not obs.explains(200.01)  # too short to count


def test_late_messages_are_split_between_machine_stalls_load_generator_stalls_and_the_rest():
    from types import SimpleNamespace

    from tools.loadtest import LagProbe, late_attribution

    obs, probe = MachineStallObserver(), LagProbe()
    obs.events = [(100.0, 0.2)]  # the whole machine stalled 200 ms at t = 100 s
    probe.events = [(300.0, 0.07), (400.0, 0.02)]  # the load generator alone: 70 ms, and 20 ms (too short)
    client = SimpleNamespace(
        arrivals=[50.0, 100.5, 101.0, 300.05, 301.0, 400.01, 500.0],
        latencies=[0.09, 0.3, 0.2, 0.25, 0.1, 0.2, 0.16],  # seconds; the budget is 148 ms
    )
    r = late_attribution([client], 148.0, obs, probe)
    assert r["late_in_machine_stalls"] == 2  # 100.5 and 101.0
    assert r["late_in_client_stalls"] == 1  # 300.05 (301.0 is on time)
    assert r["late_other"] == 2  # 400.01 (after a stall under 32 ms) and 500.0
    assert r["machine_stalls"] == 1 and r["machine_stall_max_ms"] == 200.0
    r = late_attribution([client], 148.0, obs)  # without the probe nothing is put on the load generator
    assert r["late_in_client_stalls"] == 0 and r["late_other"] == 3


def test_metrics_expose_loop_lag_and_gc_pauses(http):
    def lag_count():
        line = next(ln for ln in http.get("/metrics").text.splitlines() if ln.startswith("tim_event_loop_lag_seconds_count"))
        return float(line.split()[-1])

    first = lag_count()
    time.sleep(0.3)
    assert lag_count() >= first + 3  # the monitor ticks every 50 ms while the server runs
    assert "# TYPE tim_gc_pause_seconds histogram" in http.get("/metrics").text


def test_the_load_generators_budget_includes_the_streams_resampling():
    """A 48 kHz stream waits 2 x 6.6875 ms of resampling more than a 16 kHz one: its late threshold
    (the stream's latency, a chunk and 64 ms) moves with it."""
    from tools.loadtest import default_budget_ms

    ready = {"latency_ms": 64.0, "sample_rate": 16000}
    assert default_budget_ms(ready, 16000, 20.0) == 148.0
    assert default_budget_ms(ready, 48000, 20.0) == 161.375
