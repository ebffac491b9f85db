"""Batched inference, the event loop's side: the inference workers (`server.scheduling.worker`), admission
of jobs (live streams and files) onto them (`server.scheduling.admission`), and the `Job` a handler and
its worker hold for each (`server.scheduling.jobs`).

The event loop never runs inference. Each `Worker` thread owns one lane pool on the shared
onnxruntime session and steps every job with a pending hop in one batched call per round
(`server.scheduling.batcher`). A job with nothing pending is simply not in the round, so it delays no one;
new audio that arrives during a round joins the next one (dynamic batching, no added wait).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import threading
import time

from enhancer.devices import providers_for
from enhancer.runtime import Enhancer
from server.errors import ErrorKind, ServiceError
from server.messages import Source
from server.metrics import Metrics
from server.scheduling import capacity as calibration
from server.scheduling.admission import Admission, LaneLedger, check_parameters
from server.scheduling.capacity import TICK_S, Capacity, CapacityTracker
from server.scheduling.jobs import Job, Open
from server.scheduling.worker import Worker
from server.settings import Settings

SWITCH_INTERVAL_S = 0.0005  # GIL hand-over bound for the inference threads (Python's default: 5 ms)

log = logging.getLogger("tim_enhancer.server")


class SwitchInterval:
    """The interpreter's GIL switch interval, lowered while any scheduler runs and restored when
    the last one stops. The workers hold the GIL only between onnxruntime calls, but each time they
    want it back the event loop may keep it for a whole switch interval (5 ms by default): a third
    of a hop."""

    _lock = threading.Lock()
    _holders = 0
    _saved: float | None = None

    @classmethod
    def lower(cls, seconds: float = SWITCH_INTERVAL_S) -> None:
        with cls._lock:
            if cls._holders == 0:
                cls._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(cls._saved, seconds))
            cls._holders += 1

    @classmethod
    def restore(cls) -> None:
        with cls._lock:
            if cls._holders == 0:
                return
            cls._holders -= 1
            if cls._holders == 0 and cls._saved is not None:
                sys.setswitchinterval(cls._saved)
                cls._saved = None


class Scheduler:
    """The inference workers and admission onto them; used from the event loop."""

    def __init__(self, settings: Settings, metrics: Metrics):
        self.settings, self.metrics = settings, metrics
        self.admission = Admission(settings, metrics)
        self.workers: list[Worker] = []
        self.jobs: dict[int, Job] = {}
        self._ids = itertools.count(1)
        self.tracker: CapacityTracker | None = None  # a measured capacity that follows the machine
        # the event loop's CPU per live stream and hop, measured while serving (what Settings.loop_ms estimates)
        self.loop_ms_per_stream: float | None = None
        self.hop_s = 0.0  # set once the model is loaded

    # lifecycle
    def start(self) -> None:
        s = self.settings
        providers = providers_for(s.device)
        if s.step_server:  # the model steps in the step server; the local copy only gives the config
            providers = ["CPUExecutionProvider"]
        elif s.device == "cuda":
            import onnxruntime as ort

            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise RuntimeError("device 'cuda' requested but onnxruntime has no CUDAExecutionProvider "
                                   "(install the [gpu] extra on a machine with CUDA)")
        # One onnxruntime session for all workers (its run() is thread-safe): one copy of the weights
        # in the caches instead of one per worker; each worker keeps its own lane pool.
        enh = Enhancer.from_pretrained(s.model, providers=providers, threads=s.threads)
        log.debug("model digest %s", enh.engine.identity)  # resumed streams are checked against it: hashed now, not then
        admission = self.admission
        pools = [None] * s.workers
        if s.step_server:
            from server.stepserver import RemoteLanePool, StepServerError

            try:
                pools = [RemoteLanePool(s.step_server, s.lanes_per_worker, enh.engine, s.step_key)
                         for _ in range(s.workers)]
            except StepServerError as e:
                raise RuntimeError(str(e)) from None
            log.info("stepping through the step server at %s (%s, %s)", s.step_server, pools[0].info["provider"],
                     pools[0].info["pool"])
        workers = [Worker(i, enh, s.lanes_per_worker, self.metrics, s.max_batch_wait_ms / 1000, settings=s,
                          service_live=lambda: admission.live_lanes, pool=pools[i])
                   for i in range(s.workers)]
        capacity = self._measure(workers)
        admission.set_capacity(capacity, [w.ledger for w in workers])
        if capacity.calibrated and s.capacity_follow:
            self.tracker = CapacityTracker(capacity, s.max_streams, s.capacity_raise_s, s.capacity_lower_s)
            for w in workers:
                w.probing = True
            log.info("capacity follows the machine: re-estimated every %g s from the step timings (raised after "
                     "%g s with %d%% of the budget free, lowered after %g s over it; overhead per worker %s lanes)",
                     TICK_S, s.capacity_raise_s, round(100 * self.tracker.headroom), s.capacity_lower_s,
                     [round(w.overhead, 1) for w in self.tracker.workers])
        # lowered only once calibrated: a calibration with the hand-over already lowered measured a
        # capacity that the service then served late (server/README, Capacity)
        SwitchInterval.lower()
        for w in workers:
            w.start()
        self.workers = workers

    def _measure(self, workers: list[Worker]) -> Capacity:
        """Capacity from the settings, or timed on this machine (before the workers start)."""
        s, cfg = self.settings, workers[0].enhancer.config
        hop_s = self.hop_s = cfg.stft.hop / cfg.stft.sample_rate
        if s.capacity is not None:
            cap = calibration.fixed(s.capacity, len(workers), s.max_streams, hop_s, s.capacity_margin)
            calibration.warm([w.pool for w in workers], cap.per_worker, hop_s)
            return cap
        return calibration.calibrate([w.pool for w in workers], hop_s, s.capacity_margin, s.max_streams,
                                     loop_ms=s.loop_ms)

    def follow_tick(self, now: float | None = None) -> Capacity | None:
        """Re-estimate the capacity from the workers' step timings since the last tick (event loop)."""
        if self.tracker is None or not self.workers:
            return None
        samples = [w.take_timings() for w in self.workers]
        before = dict(self.tracker.changes)
        cap = self.tracker.update(time.monotonic() if now is None else now, samples,
                                  [ledger.live for ledger in self.ledgers])
        for i, w in enumerate(self.tracker.workers):
            if w.cost_ms is not None:
                self.metrics.projected_step.labels(worker=str(i)).set(w.projected_ms() / 1000)
        if cap is not None:
            for direction, n in self.tracker.changes.items():
                if n > before[direction]:
                    self.metrics.capacity_changes.labels(direction=direction).inc(n - before[direction])
            self.admission.update_capacity(cap, self.tracker.reasons)
        return cap

    async def follow(self, tick_s: float = TICK_S) -> None:
        """Measure the event loop's work per stream and tick the capacity tracker (if any) until cancelled
        (the app's lifespan runs it)."""
        cpu, wall = time.thread_time(), time.monotonic()
        while True:
            await asyncio.sleep(tick_s)
            cpu, wall = self.measure_loop(cpu, wall, self.admission.live_lanes)
            try:
                self.follow_tick()
            except Exception:  # a bug here must not stop the service: the capacity stays as it is
                log.exception("re-estimating the capacity failed")

    def measure_loop(self, cpu0: float, wall0: float, streams: int) -> tuple[float, float]:
        """Update `loop_ms_per_stream` from this thread's CPU since (cpu0, wall0) with `streams` live
        (an average over ticks with streams, newer ones weighing more); -> the new (cpu, wall)."""
        cpu, wall = time.thread_time(), time.monotonic()
        hops = (wall - wall0) / self.hop_s if self.hop_s else 0.0
        if streams > 0 and hops > 0:
            ms = 1000 * (cpu - cpu0) / hops / streams
            prev = self.loop_ms_per_stream
            self.loop_ms_per_stream = ms if prev is None else 0.8 * prev + 0.2 * ms
        return cpu, wall

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        for w in self.workers:
            w.join(timeout=10)
        if self.workers:
            SwitchInterval.restore()

    @property
    def ready(self) -> bool:
        """Workers running and, with a step server, reachable from each of them."""
        return bool(self.workers) and all(w.is_alive() and w.pool.connected for w in self.workers)

    @property
    def enhancer(self) -> Enhancer:
        return self.workers[0].enhancer

    # what admission counts
    @property
    def capacity(self) -> Capacity | None:
        return self.admission.capacity

    @property
    def ledgers(self) -> list[LaneLedger]:
        return self.admission.ledgers

    @property
    def streams(self) -> int:
        return self.admission.streams

    @property
    def rest_jobs(self) -> int:
        return self.admission.rest_jobs

    @property
    def opened(self) -> int:
        return self.admission.opened

    # jobs
    def open(self, sample_rate, channels, atten_lim_db=None, metadata: bool = False,
             source: Source = Source.STREAM, band: str = "full", level: str = "model", state: bytes | None = None) -> Job:
        """A new job on the least loaded worker, or ServiceError (invalid_parameter, over_capacity).
        `state`: a suspended stream's state, which the job continues (a bad one fails the job)."""
        sample_rate = check_parameters(self.settings, sample_rate, channels, atten_lim_db)
        source = Source(source)
        if not self.ready:
            raise ServiceError(ErrorKind.INTERNAL, "inference workers are not running")
        i = self.admission.admit(source, channels)
        job = Job(next(self._ids), source, sample_rate, channels, bool(metadata), worker=self.workers[i],
                  ledger=self.ledgers[i], release=self.release)
        self.jobs[job.id] = job
        job.worker.submit(Open(job, atten_lim_db, band, level, state))
        return job

    def release(self, job: Job) -> None:
        """Give a closed job's lanes back (`Job.close`)."""
        if self.jobs.pop(job.id, None) is not None:
            self.admission.release(job.ledger, job.source, job.channels)
