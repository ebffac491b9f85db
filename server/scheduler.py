"""Batched inference, the event loop's side: admission of streams and files onto the inference
workers (`server.worker`), and the `Job` a handler holds for each.

The event loop never runs inference. Websocket and REST handlers hold a `Job` and only enqueue
commands (`server.commands`: `Open`, `Push`, `End`, `Close`); each `Worker` thread owns one lane
pool on the shared onnxruntime session and steps every stream with a pending hop in one batched
call per round. A stream with nothing pending is simply not in the round, so it delays no one; new
audio that arrives during a round joins the next one (dynamic batching, no added wait).

Admission and lateness (README, "Capacity, admission and lateness"): the scheduler admits live
streams up to the capacity measured at start-up (`server.capacity`); files (REST) only use the
lanes and the time the live streams leave free. Its ledger of reserved lanes (`WorkerLanes`, one
per worker) is kept on the event loop only; each worker counts the live lanes it holds on its
own thread.
"""
from __future__ import annotations

import asyncio
import itertools
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from enhancer.devices import providers_for
from enhancer.errors import AudioError
from enhancer.runtime import Enhancer, min_gain_for
from enhancer.signal import check_rate

from . import capacity as calibration
from .capacity import Capacity
from .commands import Close, Delivery, End, Open, Push
from .errors import ServiceError
from .metrics import Metrics
from .settings import Settings
from .worker import Worker

SWITCH_INTERVAL_S = 0.0005  # GIL hand-over bound for the inference threads (Python's default: 5 ms)
STREAM_RETRY_S = 5  # retry hint for a stream refused over capacity (streams hold their lanes for minutes)
REST_RETRY_S = 1


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


@dataclass
class WorkerLanes:
    """The scheduler's ledger of one worker's lanes (event loop only): reservations of the admitted
    jobs, and how many of them are live."""

    lanes: int  # the worker's pool
    capacity: int  # live lanes it holds within the step budget
    free: int  # lanes not reserved by an admitted job
    live: int = 0  # lanes reserved by admitted live streams

    @property
    def live_room(self) -> int:
        """Live lanes this worker can still admit."""
        return self.capacity - self.live


class Job:
    """The event-loop side of one stream: enqueue audio, await deliveries. Not thread-safe: use it
    from the event loop only."""

    def __init__(self, scheduler: "Scheduler", worker: Worker, lanes: WorkerLanes, sample_rate: int, channels: int,
                 metadata: bool, source: str):
        self.id = next(scheduler._ids)
        self.scheduler, self.worker = scheduler, worker
        self.lanes = lanes  # the worker's entry of the scheduler's ledger, where this job's lanes are reserved
        self.sample_rate, self.channels, self.metadata, self.source = sample_rate, channels, metadata, source
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Delivery] = asyncio.Queue()
        self.sent = 0  # pushes enqueued
        self.acked = 0  # pushes fully processed
        self.ended = False
        self.closed = False

    def push(self, pcm: np.ndarray) -> int:
        """Queue audio (n,) or (n, channels); returns its sequence number."""
        if self.closed or self.ended:
            raise RuntimeError("job is finished")
        self.sent += 1
        self.worker.submit(Push(self, pcm, time.perf_counter(), self.sent))
        return self.sent

    def end(self) -> None:
        """Flush the tail; the last delivery has `final=True` and the worker frees the lanes."""
        if not (self.closed or self.ended):
            self.ended = True
            self.worker.submit(End(self, self.sent))

    def close(self) -> None:
        """Drop the stream (any time, e.g. on disconnect); idempotent."""
        if not self.closed:
            self.closed = True
            self.worker.submit(Close(self))
            self.scheduler._release(self)

    async def next(self) -> Delivery:
        d = await self.queue.get()
        self.acked = max(self.acked, d.acked)
        return d

    async def process(self, pcm: np.ndarray) -> np.ndarray:
        """Push `pcm` and wait until all of it is processed; returns the output made meanwhile."""
        seq = self.push(pcm)
        parts = []
        while self.acked < seq:
            d = await self.next()
            if d.error:
                raise d.error
            parts.append(d.audio)
        return np.concatenate(parts) if parts else np.zeros((0, self.channels), np.float32)

    async def finish(self) -> np.ndarray:
        """`end` and wait for the tail."""
        self.end()
        parts = []
        while True:
            d = await self.next()
            if d.error:
                raise d.error
            parts.append(d.audio)
            if d.final:
                return np.concatenate(parts)

    def _deliver(self, d: Delivery) -> None:
        if not self.closed:
            self.queue.put_nowait(d)


class Scheduler:
    """Workers plus admission control (stream, job and lane limits); used from the event loop."""

    def __init__(self, settings: Settings, metrics: Metrics):
        self.settings, self.metrics = settings, metrics
        self.workers: list[Worker] = []
        self.lanes: list[WorkerLanes] = []  # the ledger, one per worker (event loop only)
        self._ids = itertools.count(1)
        self.streams = 0
        self.rest_jobs = 0
        self.opened = 0  # jobs ever admitted
        self.jobs: dict[int, Job] = {}
        self.capacity: Capacity | None = None  # set by start(): measured, or fixed by the settings

    # lifecycle
    def start(self) -> None:
        s = self.settings
        providers = providers_for(s.device)
        if s.device == "cuda":
            import onnxruntime as ort

            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise RuntimeError("device 'cuda' requested but onnxruntime has no CUDAExecutionProvider "
                                   "(install the [gpu] extra on a machine with CUDA)")
        # One onnxruntime session for all workers (its run() is thread-safe): one copy of the weights
        # in the caches instead of one per worker; each worker keeps its own lane pool.
        enh = Enhancer.from_pretrained(s.model, providers=providers, threads=s.threads)
        workers = [Worker(i, enh, s.lanes_per_worker, self.metrics, s.max_batch_wait_ms / 1000, settings=s,
                          service_live=self._live_held)
                   for i in range(s.workers)]
        self.capacity = self._measure(workers)
        self.lanes = [WorkerLanes(lanes=w.pool.capacity, capacity=live, free=w.pool.capacity)
                      for w, live in zip(workers, self.capacity.per_worker)]
        for w, ledger in zip(workers, self.lanes):
            w.capacity = ledger.capacity  # before the thread starts
        # lowered only now: calibrated with the GIL hand-over already lowered, a 2-core Zen 5 measured
        # 27-35 streams and served them 40-787 messages late in 60 s; at Python's default it measured
        # 12-32 and served every one on time (server/README, Capacity)
        SwitchInterval.lower()
        for w in workers:
            w.start()
        self.workers = workers

    def _measure(self, workers: list[Worker]) -> Capacity:
        """Capacity from the settings, or timed on this machine (before the workers start)."""
        s, cfg = self.settings, workers[0].enhancer.config
        hop_s = cfg.stft.hop / cfg.stft.sample_rate
        if s.capacity is not None:
            cap = calibration.fixed(s.capacity, len(workers), s.max_streams, hop_s, s.capacity_margin)
        else:
            cap = calibration.calibrate([w.pool for w in workers], hop_s, s.capacity_margin, s.max_streams)
        m = self.metrics
        m.capacity.set(cap.streams)
        m.step_budget.set(cap.budget_ms / 1000)
        m.calibrated.set(int(cap.calibrated))
        for i, lanes in enumerate(cap.per_worker):
            m.capacity_worker.labels(worker=str(i)).set(lanes)
        return cap

    def _live_lanes(self) -> int:
        """Live lanes admitted (the ledger, event loop)."""
        return sum(ledger.live for ledger in self.lanes)

    def _live_held(self) -> int:
        """Live lanes the workers hold (read from a worker thread; each count has one writer)."""
        return sum(w.live_lanes for w in self.workers)

    @property
    def live_full(self) -> bool:
        """No live stream can be admitted now (checked at the websocket handshake)."""
        cap = self.capacity
        return cap is not None and (self.streams >= self.settings.max_streams or self._live_lanes() >= cap.streams
                                    or not any(ledger.live_room > 0 for ledger in self.lanes))

    def over_capacity(self, source: str, channels: int = 1) -> ServiceError:
        cap = self.capacity.streams if self.capacity else self.settings.max_streams
        self.metrics.refused.labels(source=source).inc()
        if source == "stream":
            free = max(max((ledger.live_room for ledger in self.lanes), default=0), 0)
            room = ("all are in use" if free == 0 or self.streams >= self.settings.max_streams else
                    f"a worker has room for {free} channel(s), this stream has {channels}")
            return ServiceError(
                "over_capacity", f"over capacity: this server holds {cap} live stream(s) in real time (mono; each "
                f"channel counts) and {room}; retry in {STREAM_RETRY_S} s or use another instance",
                {"capacity": cap, "active_streams": self.streams}, STREAM_RETRY_S)
        return ServiceError("over_capacity", f"over capacity: the live streams use all of this server's inference "
                            f"capacity ({cap} streams); retry in {REST_RETRY_S} s",
                            {"capacity": cap, "active_streams": self.streams}, REST_RETRY_S)

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        for w in self.workers:
            w.join(timeout=10)
        if self.workers:
            SwitchInterval.restore()

    @property
    def ready(self) -> bool:
        return bool(self.workers) and all(w.is_alive() for w in self.workers)

    @property
    def enhancer(self) -> Enhancer:
        return self.workers[0].enhancer

    def public_capacity(self) -> dict:
        """Capacity and live count for /readyz."""
        cap = self.capacity
        out = cap.public() if cap is not None else {}
        return out | {"active_streams": self.streams, "live_lanes": self._live_lanes(),
                      "free": max((cap.streams if cap else 0) - self._live_lanes(), 0)}

    # admission
    def open(self, sample_rate, channels, atten_lim_db=None, metadata: bool = False, source: str = "stream") -> Job:
        """A new job on the least loaded worker, or ServiceError (invalid_parameter, over_capacity)."""
        s = self.settings
        try:
            sample_rate = check_rate(sample_rate)
        except AudioError as e:
            raise ServiceError("invalid_parameter", str(e)) from None
        if not isinstance(channels, int) or isinstance(channels, bool) or not 1 <= channels <= s.max_channels:
            raise ServiceError("invalid_parameter", f"channels must be an integer in 1..{s.max_channels}, got {channels!r}")
        try:
            min_gain_for(atten_lim_db)
        except AudioError as e:
            raise ServiceError("invalid_parameter", str(e)) from None
        if source == "rest" and self.rest_jobs >= s.max_rest_jobs:
            self.metrics.refused.labels(source=source).inc()
            raise ServiceError("over_capacity", f"server is at its limit of {s.max_rest_jobs} concurrent "
                               f"enhancements; retry in {REST_RETRY_S} s", retry_after_s=REST_RETRY_S)
        if not self.ready:
            raise ServiceError("internal", "inference workers are not running")
        i = max(range(len(self.workers)), key=lambda i: (self.lanes[i].live_room, self.lanes[i].free))
        ledger = self.lanes[i]
        if source == "stream":
            # admitted live lanes stay within the measured capacity, in total and on the chosen worker
            if self.streams >= s.max_streams or self._live_lanes() + channels > self.capacity.streams:
                raise self.over_capacity(source, channels)
            if ledger.live_room < channels:
                raise self.over_capacity(source, channels)
        elif ledger.live_room <= 0:
            # files use what the live streams leave: refused when live streams hold every worker's capacity
            raise self.over_capacity(source)
        if ledger.free < channels:
            raise ServiceError("over_capacity", "no free inference lanes; retry later", retry_after_s=REST_RETRY_S)
        job = Job(self, self.workers[i], ledger, sample_rate, channels, bool(metadata), source)
        ledger.free -= channels
        if source == "stream":
            ledger.live += channels
        self.jobs[job.id] = job
        self.opened += 1
        if source == "stream":
            self.streams += 1
            self.metrics.active_streams.set(self.streams)
        else:
            self.rest_jobs += 1
            self.metrics.active_jobs.set(self.rest_jobs)
        job.worker.submit(Open(job, atten_lim_db))
        return job

    def _release(self, job: Job) -> None:
        if self.jobs.pop(job.id, None) is None:
            return
        job.lanes.free += job.channels
        if job.source == "stream":
            job.lanes.live -= job.channels
            self.streams -= 1
            self.metrics.active_streams.set(self.streams)
        else:
            self.rest_jobs -= 1
            self.metrics.active_jobs.set(self.rest_jobs)
