"""Batched inference: worker threads step every stream with a pending hop in one `LanePool.step`.

The event loop never runs inference. Websocket and REST handlers hold a `Job` and only enqueue
commands (`push`, `end`, `close`); each `Worker` thread owns one onnxruntime session and its
`LanePool`, and repeats rounds:

    apply queued commands -> gather every live stream with >= 1 ready hop -> one batched step ->
    each file (REST job or flushing stream) with ready hops: one multi-frame call of its backlog ->
    scatter outputs -> hand finished output to the loop (call_soon_threadsafe)

A stream with nothing pending is simply not in the round, so it delays no one; new audio that
arrives during a round joins the next one (dynamic batching, no added wait). Files run up to
`FILE_FRAMES` hops per call (`LanePool.run`: every weight read once per chunk), or
`FILE_FRAMES_BESIDE_LIVE` while live streams share the worker, so that a file never holds a live
hop back for long. All pool and stream-state operations of a worker happen on its thread.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from enhancer.errors import AudioError
from enhancer.runtime import OFFLINE_FRAMES, Enhancer, LanePool, StreamingEnhancer, min_gain_for
from enhancer.signal import check_rate

from .errors import ServiceError
from .metrics import Metrics
from .settings import Settings

FILE_FRAMES = OFFLINE_FRAMES  # hops per call of a file's backlog when no live stream shares the worker
FILE_FRAMES_BESIDE_LIVE = 4  # ... when live streams do: such a call costs about one batched live step
SWITCH_INTERVAL_S = 0.0005  # GIL hand-over bound for the inference threads (Python's default: 5 ms)

log = logging.getLogger("tim_enhancer.server")


@dataclass
class Delivery:
    """Output of a stream handed to its handler: audio (n, channels) float32 at the stream's rate."""

    audio: np.ndarray
    frames: list = field(default_factory=list)  # (frame index, competition (c, n_tim, n_s) | None, activity (c,))
    acked: int = 0  # sequence number of the last push whose audio is fully processed
    final: bool = False  # the stream's tail after `end`; nothing follows
    error: ServiceError | None = None


# ---------------------------------------------------------------------------------- loop side
class Job:
    """The event-loop side of one stream: enqueue audio, await deliveries. Not thread-safe: use it
    from the event loop only."""

    def __init__(self, scheduler: "Scheduler", worker: "Worker", sample_rate: int, channels: int, metadata: bool,
                 source: str):
        self.id = next(scheduler._ids)
        self.scheduler, self.worker = scheduler, worker
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
        self.worker.submit(("push", self, pcm, self.sent))
        return self.sent

    def end(self) -> None:
        """Flush the tail; the last delivery has `final=True` and the worker frees the lanes."""
        if not (self.closed or self.ended):
            self.ended = True
            self.worker.submit(("end", self, None, self.sent))

    def close(self) -> None:
        """Drop the stream (any time, e.g. on disconnect); idempotent."""
        if not self.closed:
            self.closed = True
            self.worker.submit(("close", self, None, 0))
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
        self._ids = itertools.count(1)
        self.streams = 0
        self.rest_jobs = 0
        self.opened = 0  # jobs ever admitted
        self.jobs: dict[int, Job] = {}

    # lifecycle
    def start(self) -> None:
        s = self.settings
        providers = {"auto": None, "cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider"]}[s.device]
        if s.device == "cuda":
            import onnxruntime as ort

            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise RuntimeError("device 'cuda' requested but onnxruntime has no CUDAExecutionProvider "
                                   "(install the [gpu] extra on a machine with CUDA)")
        # One onnxruntime session for all workers (its run() is thread-safe): one copy of the weights
        # in the caches instead of one per worker; each worker keeps its own lane pool.
        enh = Enhancer.from_pretrained(s.model, providers=providers, threads=s.threads)
        workers = [Worker(i, enh, s.lanes_per_worker, self.metrics, s.max_batch_wait_ms / 1000)
                   for i in range(s.workers)]
        # The workers hold the GIL only between onnxruntime calls, but each time they want it back the
        # event loop may keep it for a whole switch interval (5 ms by default): a third of a hop.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        for w in workers:
            w.start()
        self.workers = workers

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        for w in self.workers:
            w.join(timeout=10)

    @property
    def ready(self) -> bool:
        return bool(self.workers) and all(w.is_alive() for w in self.workers)

    @property
    def enhancer(self) -> Enhancer:
        return self.workers[0].enhancer

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
        if source == "stream" and self.streams >= s.max_streams:
            raise ServiceError("over_capacity", f"server is at its limit of {s.max_streams} concurrent streams; retry later")
        if source == "rest" and self.rest_jobs >= s.max_rest_jobs:
            raise ServiceError("over_capacity", f"server is at its limit of {s.max_rest_jobs} concurrent enhancements; retry later")
        if not self.ready:
            raise ServiceError("internal", "inference workers are not running")
        worker = max(self.workers, key=lambda w: w.lanes_free)
        if worker.lanes_free < channels:
            raise ServiceError("over_capacity", "no free inference lanes; retry later")
        job = Job(self, worker, sample_rate, channels, bool(metadata), source)
        worker.lanes_free -= channels
        self.jobs[job.id] = job
        self.opened += 1
        if source == "stream":
            self.streams += 1
            self.metrics.active_streams.set(self.streams)
        else:
            self.rest_jobs += 1
            self.metrics.active_jobs.set(self.rest_jobs)
        worker.submit(("open", job, atten_lim_db, 0))
        return job

    def _release(self, job: Job) -> None:
        if self.jobs.pop(job.id, None) is None:
            return
        job.worker.lanes_free += job.channels
        if job.source == "stream":
            self.streams -= 1
            self.metrics.active_streams.set(self.streams)
        else:
            self.rest_jobs -= 1
            self.metrics.active_jobs.set(self.rest_jobs)


# ---------------------------------------------------------------------------------- worker side
class _Stream:
    """A worker's state for one job."""

    __slots__ = ("job", "se", "gain", "acked", "flushing", "dirty", "steps", "frames", "ready_since")

    def __init__(self, job: Job, se: StreamingEnhancer):
        self.job, self.se = job, se
        self.gain = np.full(se.channels, se.min_gain, np.float32)
        self.acked = 0
        self.flushing = False
        self.dirty = False  # has output or an acknowledgement to deliver
        self.steps = 0  # hops stepped so far (frame index of the next step)
        self.frames: list = []  # metadata not yet delivered: (frame, competition, activity)
        self.ready_since = 0.0  # when its oldest ready hop became ready (perf_counter)


class Worker(threading.Thread):
    """An inference thread: a lane pool on the shared session, and the streams placed on it."""

    def __init__(self, index: int, enhancer: Enhancer, lanes: int, metrics: Metrics, max_wait_s: float = 0.0):
        super().__init__(name=f"tim-worker-{index}", daemon=True)
        self.index, self.enhancer, self.metrics = index, enhancer, metrics
        self.max_wait = max_wait_s  # longest a ready hop waits for other streams to join its step
        self.pool = LanePool(enhancer.engine, lanes)
        self.lanes_free = lanes  # reservations, maintained on the event loop
        self._cv = threading.Condition()
        self._inbox: collections.deque = collections.deque()
        self._stopping = False
        self.streams: dict[int, _Stream] = {}
        self._out: list[tuple[Job, Delivery]] = []
        self._acks_due = False  # a push left a stream with output to hand over but no hop to step
        self._lanes_gauge = metrics.lanes_in_use.labels(worker=str(index))

    def submit(self, cmd) -> None:
        with self._cv:
            self._inbox.append(cmd)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()

    # ------------------------------------------------------------------ thread body
    def run(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self._stopping:
                    wait = self._batch_wait()
                    if wait == 0:
                        break
                    self._cv.wait(wait)  # None: until a command arrives
                if self._stopping:
                    break
                cmds = list(self._inbox)
                self._inbox.clear()
            try:
                for cmd in cmds:
                    self._apply_one(cmd)
                if cmds and self._batch_wait() != 0:  # the step waits for more streams
                    if self._acks_due:
                        self._deliver()  # acknowledge pushes too short to make a hop
                    continue
                self._round()
                self._deliver()
            except Exception as e:  # noqa: BLE001 - a bug: fail the streams on this worker, keep serving
                log.exception("inference worker %d failed; closing its streams", self.index)
                for st in list(self.streams.values()):
                    self._fail(st.job, e, internal=True)
                    self._drop(st)
        for st in list(self.streams.values()):
            self._drop(st)

    def _batch_wait(self) -> float | None:
        """Seconds to hold the next step so that more live streams join it (0: step now, None:
        nothing to step). A step waits until every live stream has a hop ready, or until the oldest
        ready hop has waited `max_wait`: big batches cost far less per stream than small ones, and
        a live stream needs only one step per 16 ms. Files and flushing streams never wait when no
        live stream is ready; otherwise they run in the live streams' rounds (`_run_file`)."""
        ready_live, ready_other, live = [], False, 0
        for st in self.streams.values():
            is_live = st.job.source == "stream" and not st.flushing
            live += is_live
            if st.se.ready_hops():
                if is_live:
                    ready_live.append(st)
                else:
                    ready_other = True
        if not ready_live:
            return 0 if ready_other else None
        if self.max_wait <= 0 or len(ready_live) >= live:
            return 0
        remaining = min(st.ready_since for st in ready_live) + self.max_wait - time.perf_counter()
        return remaining if remaining > 0 else 0

    def _apply_one(self, cmd) -> None:
        """Apply one command; a failure closes that command's stream only."""
        try:
            self._apply(*cmd)
        except Exception as e:  # noqa: BLE001
            job = cmd[1]
            log.exception("stream %d: %s failed", job.id, cmd[0])
            self._fail(job, e, internal=True)
            st = self.streams.get(job.id)
            if st is not None:
                self._drop(st)

    def _apply(self, op: str, job: Job, arg, seq: int) -> None:
        st = self.streams.get(job.id)
        if op == "open":
            try:
                se = StreamingEnhancer(self.enhancer.engine, job.sample_rate, job.channels, arg, False, self.pool)
            except Exception as e:  # noqa: BLE001 - reported to the client, the worker goes on
                self._fail(job, e)
                return
            self.streams[job.id] = _Stream(job, se)
            self._lanes_gauge.set(self.pool.capacity - self.pool.n_free)
        elif st is None:
            return  # closed or failed already
        elif op == "push":
            had_hop = st.se.ready_hops() > 0
            try:
                st.se.push(arg, "audio")
            except Exception as e:  # noqa: BLE001
                self._fail(job, e)
                self._drop(st)
                return
            st.acked, st.dirty = seq, True
            if not had_hop:
                st.ready_since = time.perf_counter()
            if not st.se.ready_hops():
                self._acks_due = True
        elif op == "end":
            st.se.begin_flush()
            st.flushing, st.dirty, st.acked = True, True, seq
            self._acks_due = True
        elif op == "close":
            self._drop(st)

    def _round(self) -> None:
        """One batched step over every live stream with a ready hop, then one multi-frame call per
        file with ready hops (`_run_file`)."""
        live, files = [], []
        for st in self.streams.values():
            if st.se.ready_hops():
                (live if st.job.source == "stream" and not st.flushing else files).append(st)
        self._round_live(live)
        frames = FILE_FRAMES_BESIDE_LIVE if any(st.job.source == "stream" and not st.flushing
                                                for st in self.streams.values()) else FILE_FRAMES
        for st in files:
            if st.job.id in self.streams:
                self._run_file(st, frames)

    def _run_file(self, st: _Stream, frames: int) -> None:
        """Up to `frames` ready hops of one stream in one call (`LanePool.run`); a failure closes
        that stream only (the pool's state only changes when a call succeeds)."""
        se = st.se
        n = min(se.ready_hops(), frames)
        try:
            r = self.pool.run(se.lanes, se.take_hops(n), st.gain)
            self.metrics.batch_size.observe(len(se.lanes))
            se.put_outputs(r.out, None, None)
            if st.job.metadata:
                st.frames.extend((st.steps + t, None if r.competition is None else r.competition[:, t], r.activity[:, t])
                                 for t in range(n))
        except Exception as e:  # noqa: BLE001
            log.exception("inference of %d hop(s) of stream %d failed: closing it", n, st.job.id)
            self._fail(st.job, e, internal=True)
            self._drop(st)
            return
        st.steps += n
        st.dirty = True
        self.metrics.frames.labels(source=st.job.source).inc(n)
        if se.ready_hops():
            st.ready_since = time.perf_counter()

    def _round_live(self, ready: list[_Stream]) -> None:
        """One batched step over the live streams with a ready hop. If the batched call fails, each
        stream is retried alone (the pool's state only changes when a step succeeds), so a fault
        tied to one stream closes that stream only and a transient one closes none."""
        if not ready:
            return
        hops = [st.se.take_hop() for st in ready]  # (channels, hop) each
        try:
            r = self._step(ready, hops)
        except Exception:  # noqa: BLE001
            log.exception("inference step of %d stream(s) failed; retrying them one by one", len(ready))
            for st, hop in zip(ready, hops):
                try:
                    r = self._step([st], [hop])
                except Exception as e:  # noqa: BLE001
                    log.error("inference step failed again for stream %d alone: closing it (%s)", st.job.id,
                              type(e).__name__)
                    self._fail(st.job, e, internal=True)
                    self._drop(st)
                    continue
                self._scatter([st], r)
            return
        self._scatter(ready, r)

    def _step(self, group: list[_Stream], hops: list[np.ndarray]):
        lanes = np.concatenate([st.se.lanes for st in group])
        gains = np.concatenate([st.gain for st in group])
        t0 = time.perf_counter()
        r = self.pool.step(lanes, np.concatenate(hops), gains)
        self.metrics.step_seconds.observe(time.perf_counter() - t0)
        self.metrics.batch_size.observe(len(lanes))
        return r

    def _scatter(self, group: list[_Stream], r) -> None:
        """Hand each stream its slice of a step's result (a stream whose bookkeeping fails is
        closed alone)."""
        o = 0
        counts = collections.Counter()
        for st in group:
            c = st.se.channels
            try:
                comp = None if r.competition is None else r.competition[o:o + c]
                st.se.put_output(r.out[o:o + c], None, None)
                if st.job.metadata:
                    st.frames.append((st.steps, comp, r.activity[o:o + c]))
            except Exception as e:  # noqa: BLE001
                log.exception("stream %d: output bookkeeping failed", st.job.id)
                self._fail(st.job, e, internal=True)
                self._drop(st)
            else:
                st.steps += 1
                st.dirty = True
                counts[st.job.source] += 1
            o += c
        for source, n in counts.items():
            self.metrics.frames.labels(source=source).inc(n)
        now = time.perf_counter()
        for st in group:  # a hop left over counts as ready from now (a backlog of one chunk is no delay)
            if st.job.id in self.streams and st.se.ready_hops():
                st.ready_since = now

    def _deliver(self) -> None:
        """Hand over output: live streams after every round they took part in (so a stream that is
        behind still gets audio hop by hop), files and flushing streams once they have no hop left.
        A push is acknowledged once all of its audio has been stepped."""
        self._acks_due = False
        for st in list(self.streams.values()):
            if not st.dirty:
                continue
            try:
                self._deliver_one(st)
            except Exception as e:  # noqa: BLE001
                log.exception("stream %d: delivering output failed", st.job.id)
                self._fail(st.job, e, internal=True)
                self._drop(st)
        self._post()

    def _deliver_one(self, st: _Stream) -> None:
        se = st.se
        drained = not se.ready_hops()
        if not drained and (st.flushing or st.job.source != "stream"):
            return
        st.dirty = not drained
        if st.flushing:
            audio, final = se.end_flush(), True
        else:
            audio, final = se.pull().reshape(-1, se.channels), False
        frames, st.frames = st.frames, []
        acked = st.acked if drained else 0
        self._out.append((st.job, Delivery(audio, frames, acked, final)))
        if final:
            self._drop(st)

    def _fail(self, job: Job, e: Exception, internal: bool = False) -> None:
        if isinstance(e, AudioError) and not internal:
            err = ServiceError("invalid_audio", str(e))
        else:
            err = ServiceError("internal", "inference failed; the stream was closed")
        self._out.append((job, Delivery(np.zeros((0, job.channels), np.float32), [], job.sent, True, err)))
        self._post()

    def _drop(self, st: _Stream) -> None:
        self.streams.pop(st.job.id, None)
        st.se.close()
        self._lanes_gauge.set(self.pool.capacity - self.pool.n_free)

    def _post(self) -> None:
        if not self._out:
            return
        items, self._out = self._out, []
        by_loop = collections.defaultdict(list)
        for job, d in items:
            by_loop[job.loop].append((job, d))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_dispatch, batch)
            except RuntimeError:  # loop closed (shutdown): nobody is listening any more
                pass


def _dispatch(batch) -> None:
    for job, d in batch:
        job._deliver(d)
