"""An inference worker: a thread that owns a lane pool on the shared onnxruntime session and the
jobs placed on it (`server.scheduling.admission` places them), and repeats:

    apply queued commands -> one batching round (`server.scheduling.batcher`) -> hand finished output to
    the loop (call_soon_threadsafe)

Every pool operation of a worker, and every write of a job's worker-side fields
(`server.scheduling.jobs.Job`), happens on its thread. What files may use of
it is `server.scheduling.duty`'s; when a live job is late, and when it skips its backlog, is
`server.scheduling.lateness`'s.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from enhancer.cursor import StreamCursor
from enhancer.device_pool import make_pool
from enhancer.errors import AudioError, StateError
from enhancer.pools import LanePoolProtocol
from enhancer.runtime import Enhancer
from server.errors import ErrorKind, ServiceError, from_core
from server.metrics import Metrics
from server.scheduling.admission import LaneLedger
from server.scheduling.batcher import Batcher
from server.scheduling.capacity import PROBE_INTERVAL_S, PROBE_LANES
from server.scheduling.duty import FileShare
from server.scheduling.jobs import Close, Command, Delivery, End, Job, Open, Push
from server.scheduling.lateness import LatenessPolicy
from server.settings import Settings

log = logging.getLogger("tim_enhancer.server")


class Worker(threading.Thread):
    """An inference thread: a lane pool on the shared session, and the jobs placed on it (`jobs`:
    the same `Job` objects the event loop holds).

    `ledger` is this worker's `LaneLedger` (capacity and admitted lanes); `service_live()` is the
    number of live lanes admitted in the whole service: files step on their own only within a duty
    cycle while there are any."""

    def __init__(self, index: int, enhancer: Enhancer, pool_size: int, metrics: Metrics, max_wait_s: float = 0.0,
                 settings: Settings | None = None, service_live: Callable[[], int] | None = None,
                 pool: LanePoolProtocol | None = None):
        super().__init__(name=f"tim-worker-{index}", daemon=True)
        s = settings or Settings()
        self.index, self.enhancer, self.metrics, self.max_state_bytes = index, enhancer, metrics, s.max_state_bytes
        # on CUDA the caches stay on the GPU; with a step server, `pool` is a RemoteLanePool
        self.pool = pool if pool is not None else make_pool(enhancer.engine, pool_size, full_steps=s.full_steps,
                                                                      device_pool=s.device_pool)
        self.ledger = LaneLedger(size=pool_size, capacity=pool_size, free=pool_size)  # admission sets the capacity
        cfg = enhancer.config
        hop_s = cfg.stft.hop / cfg.stft.sample_rate
        self.jobs: dict[int, Job] = {}
        self.files = FileShare(self.ledger, hop_s, s.capacity_margin, service_live or (lambda: 0))
        self.lateness = LatenessPolicy(s, hop_s, metrics, str(index))
        self.batcher = Batcher(self.pool, self.jobs, metrics, self.lateness, self.files, max_wait_s,
                               self._close_failed)
        self._cv = threading.Condition()
        self._inbox: collections.deque = collections.deque()
        self._stopping = False
        self._out: list[tuple[Job, Delivery]] = []
        self._acks_due = False  # a push left a job with output to hand over but no hop to step
        self._lanes_gauge = metrics.lanes_in_use.labels(worker=str(index))
        # step timings for the capacity that follows the machine (server.scheduling.capacity.CapacityTracker): the
        # batched live steps, and while `probing` and the worker holds no job, a probe step of up to
        # PROBE_LANES free lanes every PROBE_INTERVAL_S (an idle replica's capacity follows the machine too)
        self.timings: collections.deque = collections.deque(maxlen=4096)
        self.batcher.timings = self.timings
        self.probing = False
        self._next_probe = 0.0
        self._probe_hops = (0.05 * np.random.default_rng(index).standard_normal(
            (PROBE_LANES, cfg.stft.hop))).astype(np.float32)

    @property
    def live_lanes(self) -> int:
        """Lanes of the live jobs this worker holds now."""
        return sum(job.channels for job in self.jobs.values() if job.live)

    def take_timings(self) -> list[tuple[int, float]]:
        """(lanes, seconds) of the steps timed since the last call (any thread)."""
        out = []
        while True:
            try:
                out.append(self.timings.popleft())
            except IndexError:
                return out

    def _probe_in(self) -> float | None:
        """Seconds until the next probe step is due; None when none is (not probing, or jobs held)."""
        if not self.probing or self.jobs:
            return None
        return self._next_probe - time.perf_counter()

    def _probe(self) -> None:
        """Time one step of up to PROBE_LANES free lanes (the worker holds no job)."""
        n = min(max(self.ledger.capacity, 1), PROBE_LANES, self.pool.n_free)
        try:
            if n > 0:
                lanes = self.pool.alloc(n)  # reset: the probe's state never reaches a job
                try:
                    t0 = time.perf_counter()
                    self.pool.step(lanes, self._probe_hops[:n], np.ones(n, np.float32))
                    self.timings.append((n, time.perf_counter() - t0))
                finally:
                    self.pool.free(lanes)
        except Exception:  # a probe that fails changes nothing; the next one tries again
            log.warning("worker %d: a capacity probe step failed", self.index, exc_info=True)
        self._next_probe = time.perf_counter() + PROBE_INTERVAL_S

    def submit(self, cmd: Command) -> None:
        """Queue a command (any thread); the worker applies the commands in order."""
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
                    wait = self.batcher.wait()
                    if wait == 0:
                        break
                    probe = self._probe_in()
                    if probe is not None:
                        if probe <= 0:
                            break
                        wait = probe if wait is None else min(wait, probe)
                    self._cv.wait(wait)  # None: until a command arrives
                if self._stopping:
                    break
                cmds = list(self._inbox)
                self._inbox.clear()
            try:
                for cmd in cmds:
                    self.apply(cmd)
                probe = self._probe_in()
                if probe is not None and probe <= 0:
                    self._probe()
                    continue
                if cmds and self.batcher.wait() != 0:  # the step waits for more live jobs
                    if self._acks_due:
                        self._deliver()  # acknowledge pushes too short to make a hop
                    continue
                self.batcher.round()
                self._deliver()
            except Exception as e:  # a bug: fail the jobs on this worker, keep serving
                log.exception("inference worker %d failed; closing its jobs", self.index)
                for job in list(self.jobs.values()):
                    self._close_failed(job, e)
        for job in list(self.jobs.values()):
            self._drop(job)

    # ------------------------------------------------------------------ commands
    def apply(self, cmd: Command) -> None:
        """Apply one command; a failure closes that command's job only."""
        try:
            self._apply(cmd)
        except Exception as e:  # a bug in this job's command: close it, keep serving
            job = cmd.job
            log.exception("job %d: %s failed", job.id, type(cmd).__name__.lower())
            self._fail(job, e, internal=True)
            self._drop(job)

    def _apply(self, cmd: Command) -> None:
        if isinstance(cmd, Open):
            self._open(cmd)
            return
        job = cmd.job
        if self.jobs.get(job.id) is not job:
            return  # closed or failed already
        if isinstance(cmd, Push):
            self._push(job, cmd)
        elif isinstance(cmd, End):
            self._end(job, cmd)
        elif isinstance(cmd, Close):
            self._drop(job)
        else:
            raise TypeError(f"unknown command {cmd!r}")

    def _open(self, cmd: Open) -> None:
        job = cmd.job
        try:
            job.cursor = open_cursor(self.enhancer.engine, self.pool, cmd)
        except (AudioError, StateError, RuntimeError) as e:  # invalid parameters or state, no free lane: reported
            self._fail(job, e)
            return
        self.jobs[job.id] = job
        self._lanes_gauge.set(self.pool.capacity - self.pool.n_free)

    def _push(self, job: Job, cmd: Push) -> None:
        c = job.cursor
        had = c.ready_hops()
        try:
            c.push(cmd.pcm, "audio")
        except AudioError as e:
            self._fail(job, e)
            self._drop(job)
            return
        job.arrivals.note_push(c.ready_hops() - had, cmd.arrived)
        job.acked, job.dirty = cmd.seq, True
        if not had:
            job.ready_since = time.perf_counter()
        if not c.ready_hops():
            self._acks_due = True

    def _end(self, job: Job, cmd: End) -> None:
        # suspended: stepped live as before up to the last whole hop (`_deliver_one`); else the tail
        job.suspending = cmd.suspend and job.live
        if not job.suspending:
            job.cursor.begin_flush()
        job.flushing, job.dirty, job.acked = not job.suspending, True, cmd.seq
        self._acks_due = True

    # ------------------------------------------------------------------ delivery
    def _deliver(self) -> None:
        """Hand over output: live jobs after every round they took part in (so a job that is behind
        still gets audio hop by hop), files and flushing jobs once they have no hop left. A push is
        acknowledged once all of its audio has been stepped."""
        self._acks_due = False
        for job in list(self.jobs.values()):
            if not job.dirty:
                continue
            try:
                self._deliver_one(job)
            except Exception as e:  # a fault of this job's output: close it alone
                log.exception("job %d: delivering output failed", job.id)
                self._close_failed(job, e)
        self._post()

    def _deliver_one(self, job: Job) -> None:
        c = job.cursor
        drained = not c.ready_hops()
        if not drained and (job.flushing or not job.live):
            return
        job.dirty = not drained
        audio, final = (c.end_flush(), True) if job.flushing else (c.pull(), False)
        # a suspended job's state ends it; without one it flushes its tail after all
        state = take_state(job, self.max_state_bytes) if job.suspending and drained else None
        final = final or state is not None
        events, job.events = job.events, []
        acked = job.acked if drained else 0
        self._out.append((job, Delivery(audio, c.log.pop(), acked, final, events=events, state=state)))
        if final:
            self._drop(job)

    def _close_failed(self, job: Job, e: Exception) -> None:
        """Inference or bookkeeping of `job` failed: tell its client (internal error) and drop it."""
        self._fail(job, e, internal=True)
        self._drop(job)

    def _fail(self, job: Job, e: Exception, internal: bool = False) -> None:
        if isinstance(e, (AudioError, StateError)) and not internal:
            err = from_core(e)
        else:
            err = ServiceError(ErrorKind.INTERNAL, "inference failed; the stream was closed")
        self._out.append((job, Delivery(np.zeros((0, job.channels), np.float32), [], job.acked, True, err)))
        self._post()

    def _drop(self, job: Job) -> None:
        self.jobs.pop(job.id, None)
        if job.cursor is not None:
            job.cursor.close()
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


def open_cursor(engine, pool: LanePoolProtocol, cmd: Open) -> StreamCursor:
    """The cursor of an opened job, continued from the command's state if it has one (a state that
    is not of this stream: StateError, and the cursor's lanes given back)."""
    job = cmd.job
    cursor = StreamCursor(engine, job.sample_rate, job.channels, cmd.atten_lim_db, job.metadata, pool, cmd.band,
                          cmd.level)
    if cmd.state is not None:
        try:
            cursor.load_state_bytes(cmd.state)
        except StateError:
            cursor.close()
            raise
    return cursor


def take_state(job: Job, max_bytes: int) -> bytes | None:
    """A suspended job's state (`StreamCursor.state_bytes`); None, and the job flushing its tail
    instead, when it cannot be taken or is over `max_bytes`."""
    try:
        state = job.cursor.state_bytes()
    except Exception:
        log.exception("job %d: its state could not be taken; sending its tail", job.id)
        state = None
    if state is not None and len(state) > max_bytes:
        log.info("job %d: its state (%d bytes) is over max_state_bytes; sending its tail", job.id, len(state))
        state = None
    if state is None:
        job.suspending = False
        job.cursor.begin_flush()
        job.flushing = job.dirty = True
    return state


def _dispatch(batch: list[tuple[Job, Delivery]]) -> None:
    for job, d in batch:
        job.deliver(d)
