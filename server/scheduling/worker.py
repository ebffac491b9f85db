"""An inference worker: a thread that owns a lane pool on the shared onnxruntime session and the
streams placed on it (`server.scheduling.admission` places them), and repeats:

    apply queued commands -> one batching round (`server.scheduling.batcher`) -> hand finished output to
    the loop (call_soon_threadsafe)

Every pool and stream-state operation of a worker happens on its thread. What files may use of
it is `server.scheduling.duty`'s; when a live stream is late, and when it skips its backlog, is
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
from enhancer.errors import AudioError
from enhancer.runtime import Enhancer
from server.errors import ErrorKind, ServiceError
from server.metrics import Metrics
from server.scheduling.admission import LaneLedger
from server.scheduling.batcher import Batcher
from server.scheduling.capacity import PROBE_INTERVAL_S, PROBE_LANES
from server.scheduling.commands import Close, Command, Delivery, End, JobHandle, Open, Push
from server.scheduling.duty import FileShare
from server.scheduling.lateness import LatenessPolicy
from server.scheduling.streams import StreamState
from server.settings import Settings

log = logging.getLogger("tim_enhancer.server")


class Worker(threading.Thread):
    """An inference thread: a lane pool on the shared session, and the streams placed on it.

    `ledger` is this worker's `LaneLedger` (capacity and admitted lanes); `service_live()` is the
    number of live lanes admitted in the whole service: files step on their own only within a duty
    cycle while there are any."""

    def __init__(self, index: int, enhancer: Enhancer, pool_size: int, metrics: Metrics, max_wait_s: float = 0.0,
                 settings: Settings | None = None, service_live: Callable[[], int] | None = None, pool=None):
        super().__init__(name=f"tim-worker-{index}", daemon=True)
        s = settings or Settings()
        self.index, self.enhancer, self.metrics = index, enhancer, metrics
        # on CUDA the caches stay on the GPU; with a step server, `pool` is a RemoteLanePool
        self.pool = pool if pool is not None else make_pool(enhancer.engine, pool_size)
        self.ledger = LaneLedger(size=pool_size, capacity=pool_size, free=pool_size)  # admission sets the capacity
        cfg = enhancer.config
        hop_s = cfg.stft.hop / cfg.stft.sample_rate
        self.streams: dict[int, StreamState] = {}
        self.files = FileShare(self.ledger, hop_s, s.capacity_margin, service_live or (lambda: 0))
        self.lateness = LatenessPolicy(s, hop_s, metrics, str(index))
        self.batcher = Batcher(self.pool, self.streams, metrics, self.lateness, self.files, max_wait_s,
                               self._close_failed)
        self._cv = threading.Condition()
        self._inbox: collections.deque = collections.deque()
        self._stopping = False
        self._out: list[tuple[JobHandle, Delivery]] = []
        self._acks_due = False  # a push left a stream with output to hand over but no hop to step
        self._lanes_gauge = metrics.lanes_in_use.labels(worker=str(index))
        # step timings for the capacity that follows the machine (server.scheduling.capacity.CapacityTracker): the
        # batched live steps, and while `probing` and the worker holds no stream, a probe step of up to
        # PROBE_LANES free lanes every PROBE_INTERVAL_S (an idle replica's capacity follows the machine too)
        self.timings: collections.deque = collections.deque(maxlen=4096)
        self.batcher.timings = self.timings
        self.probing = False
        self._next_probe = 0.0
        self._probe_hops = (0.05 * np.random.default_rng(index).standard_normal(
            (PROBE_LANES, cfg.stft.hop))).astype(np.float32)

    @property
    def live_lanes(self) -> int:
        """Lanes of the live streams this worker holds now."""
        return sum(st.channels for st in self.streams.values() if st.live)

    def take_timings(self) -> list[tuple[int, float]]:
        """(lanes, seconds) of the steps timed since the last call (any thread)."""
        out = []
        while True:
            try:
                out.append(self.timings.popleft())
            except IndexError:
                return out

    def _probe_in(self) -> float | None:
        """Seconds until the next probe step is due; None when none is (not probing, or streams held)."""
        if not self.probing or self.streams:
            return None
        return self._next_probe - time.perf_counter()

    def _probe(self) -> None:
        """Time one step of up to PROBE_LANES free lanes (the worker holds no stream)."""
        n = min(max(self.ledger.capacity, 1), PROBE_LANES, self.pool.n_free)
        try:
            if n > 0:
                lanes = self.pool.alloc(n)  # reset: the probe's state never reaches a stream
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
                if cmds and self.batcher.wait() != 0:  # the step waits for more streams
                    if self._acks_due:
                        self._deliver()  # acknowledge pushes too short to make a hop
                    continue
                self.batcher.round()
                self._deliver()
            except Exception as e:  # a bug: fail the streams on this worker, keep serving
                log.exception("inference worker %d failed; closing its streams", self.index)
                for st in list(self.streams.values()):
                    self._close_failed(st, e)
        for st in list(self.streams.values()):
            self._drop(st)

    # ------------------------------------------------------------------ commands
    def apply(self, cmd: Command) -> None:
        """Apply one command; a failure closes that command's stream only."""
        try:
            self._apply(cmd)
        except Exception as e:  # a bug in this stream's command: close it, keep serving
            job = cmd.job
            log.exception("stream %d: %s failed", job.id, type(cmd).__name__.lower())
            self._fail(job, e, internal=True)
            st = self.streams.get(job.id)
            if st is not None:
                self._drop(st)

    def _apply(self, cmd: Command) -> None:
        if isinstance(cmd, Open):
            self._open(cmd)
            return
        st = self.streams.get(cmd.job.id)
        if st is None:
            return  # closed or failed already
        if isinstance(cmd, Push):
            self._push(st, cmd)
        elif isinstance(cmd, End):
            self._end(st, cmd)
        elif isinstance(cmd, Close):
            self._drop(st)
        else:
            raise TypeError(f"unknown command {cmd!r}")

    def _open(self, cmd: Open) -> None:
        job = cmd.job
        try:
            cursor = StreamCursor(self.enhancer.engine, job.sample_rate, job.channels, cmd.atten_lim_db,
                                  job.metadata, self.pool, cmd.band)
        except (AudioError, RuntimeError) as e:  # invalid parameters, or no free lane: reported to the client
            self._fail(job, e)
            return
        self.streams[job.id] = StreamState(job, cursor)
        self._lanes_gauge.set(self.pool.capacity - self.pool.n_free)

    def _push(self, st: StreamState, cmd: Push) -> None:
        c = st.cursor
        had = c.ready_hops()
        try:
            c.push(cmd.pcm, "audio")
        except AudioError as e:
            self._fail(st.job, e)
            self._drop(st)
            return
        st.arrivals.note_push(c.ready_hops() - had, cmd.arrived)
        st.acked, st.dirty = cmd.seq, True
        if not had:
            st.ready_since = time.perf_counter()
        if not c.ready_hops():
            self._acks_due = True

    def _end(self, st: StreamState, cmd: End) -> None:
        st.cursor.begin_flush()
        st.flushing, st.dirty, st.acked = True, True, cmd.seq
        self._acks_due = True

    # ------------------------------------------------------------------ delivery
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
            except Exception as e:  # a fault of this stream's output: close it alone
                log.exception("stream %d: delivering output failed", st.job.id)
                self._close_failed(st, e)
        self._post()

    def _deliver_one(self, st: StreamState) -> None:
        c = st.cursor
        drained = not c.ready_hops()
        if not drained and (st.flushing or not st.live):
            return
        st.dirty = not drained
        audio, final = (c.end_flush(), True) if st.flushing else (c.pull(), False)
        events, st.events = st.events, []
        acked = st.acked if drained else 0
        self._out.append((st.job, Delivery(audio, c.log.pop(), acked, final, events=events)))
        if final:
            self._drop(st)

    def _close_failed(self, st: StreamState, e: Exception) -> None:
        """Inference or bookkeeping of `st` failed: tell its client (internal error) and drop it."""
        self._fail(st.job, e, internal=True)
        self._drop(st)

    def _fail(self, job: JobHandle, e: Exception, internal: bool = False) -> None:
        if isinstance(e, AudioError) and not internal:
            err = ServiceError(ErrorKind.INVALID_AUDIO, str(e))
        else:
            err = ServiceError(ErrorKind.INTERNAL, "inference failed; the stream was closed")
        self._out.append((job, Delivery(np.zeros((0, job.channels), np.float32), [], job.sent, True, err)))
        self._post()

    def _drop(self, st: StreamState) -> None:
        self.streams.pop(st.job.id, None)
        st.cursor.close()
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


def _dispatch(batch: list[tuple[JobHandle, Delivery]]) -> None:
    for job, d in batch:
        job.deliver(d)
