"""An inference worker: a thread that owns a lane pool on the shared onnxruntime session and
the streams placed on it (`server.scheduler` places them), and repeats rounds:

    apply queued commands -> gather every live stream with >= 1 ready hop -> one batched step ->
    each file (REST job or flushing stream) with ready hops: one multi-frame call of its backlog ->
    scatter outputs -> hand finished output to the loop (call_soon_threadsafe)

Every pool and stream-state operation of a worker happens on its thread, and so does the count of
the live lanes it holds (`live_lanes`), which decides how much room files get beside them.
Files run up to `FILE_FRAMES` hops per call (`LanePool.run`: every weight read once per chunk),
or `FILE_FRAMES_BESIDE_LIVE` while live streams share the worker, so that a file never holds a
live hop back for long. A live stream that falls behind the lateness budget runs its backlog
up to `BACKLOG_FRAMES` hops per call instead of one hop per round, and one whose oldest hop waits
longer than `max_lateness_ms` skips its backlog (zeros, reported to the client as a gap) instead of
falling further behind.
"""
from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np

from enhancer.errors import AudioError
from enhancer.cursor import StreamCursor
from enhancer.runtime import OFFLINE_FRAMES, Enhancer, LanePool

from .commands import Close, Command, Delivery, End, Open, Push
from .errors import ServiceError
from .metrics import Metrics
from .settings import Settings

FILE_FRAMES = OFFLINE_FRAMES  # hops per call of a file's backlog when no live stream shares the worker
FILE_FRAMES_BESIDE_LIVE = 4  # ... when live streams do: such a call costs about one batched live step
BACKLOG_FRAMES = 16  # hops per call of a live stream's backlog (it is late: it gets a larger share)

log = logging.getLogger("tim_enhancer.server")


class _Stream:
    """A worker's state for one job."""

    __slots__ = ("job", "se", "gain", "acked", "flushing", "dirty", "steps", "frames", "ready_since", "live",
                 "arrivals", "hops_in", "first_arrival", "due", "behind", "skipped", "events")

    def __init__(self, job: "Job", se: StreamCursor):  # noqa: F821 - server.scheduler.Job
        self.job, self.se = job, se
        self.gain = np.full(se.channels, se.min_gain, np.float32)
        self.acked = 0
        self.flushing = False
        self.dirty = False  # has output or an acknowledgement to deliver
        self.steps = 0  # hops stepped or skipped so far (frame index of the next step)
        self.frames: list = []  # metadata not yet delivered: (frame, competition, activity)
        self.ready_since = 0.0  # when its oldest ready hop became ready (perf_counter)
        # lateness of a live stream: hop h is due at max(arrival of the push that completed it,
        # first arrival + h hops): a client sending faster than real time is never late
        self.live = job.source == "stream"
        self.arrivals: collections.deque = collections.deque()  # (hops_in after a push, its arrival time)
        self.hops_in = 0  # hops made ready by pushes so far
        self.first_arrival: float | None = None
        self.due = 0.0  # due time of the hop in the current round
        self.behind = False  # told the client it is late, not yet that it is on time again
        self.skipped = 0  # hops skipped (not stepped) to catch up
        self.events: list = []  # JSON messages for the client, delivered with the next output

    @property
    def stepping_live(self) -> bool:
        return self.live and not self.flushing

    def note_push(self, new_hops: int, t: float) -> None:
        if new_hops > 0:
            self.hops_in += new_hops
            self.arrivals.append((self.hops_in, t))
            if self.first_arrival is None:
                self.first_arrival = t

    def due_time(self, hop: int, hop_s: float) -> float:
        """When hop `hop` (stream index) could first have been stepped by a real-time server."""
        while self.arrivals and self.arrivals[0][0] <= hop:
            self.arrivals.popleft()
        arrival = self.arrivals[0][1] if self.arrivals else 0.0
        return max(arrival, (self.first_arrival or 0.0) + hop * hop_s)


class Worker(threading.Thread):
    """An inference thread: a lane pool on the shared session, and the streams placed on it.

    `service_live()` is the number of live lanes the whole service holds (every worker's
    `live_lanes`): files step on their own only within a duty cycle while there are any."""

    def __init__(self, index: int, enhancer: Enhancer, lanes: int, metrics: Metrics, max_wait_s: float = 0.0,
                 settings: Settings | None = None, service_live=None):
        super().__init__(name=f"tim-worker-{index}", daemon=True)
        s = settings or Settings()
        self.index, self.enhancer, self.metrics = index, enhancer, metrics
        self.max_wait = max_wait_s  # longest a ready hop waits for other streams to join its step
        self.pool = LanePool(enhancer.engine, lanes)
        self.capacity = lanes  # live lanes this worker holds within the step budget (set before it starts)
        self.live_lanes = 0  # lanes of the live streams on this worker: changed on its thread only
        cfg = enhancer.config
        self.hop, self.delay, self.model_rate = cfg.stft.hop, cfg.delay_samples, cfg.stft.sample_rate
        self.hop_s = self.hop / self.model_rate
        self.late_s = s.lateness_budget_ms / 1000  # a hop stepped later than this: tell the client
        self.skip_s = s.max_lateness_ms / 1000  # an oldest hop waiting longer than this: skip the backlog
        # files step on their own only within a duty cycle while live streams are served anywhere
        # (the cores are shared): credit refills at (1 - margin) s per s, every step spends its time
        self.duty = 1.0 - s.capacity_margin
        self._credit, self._credit_t = 0.0, time.perf_counter()
        self._service_live = service_live or (lambda: 0)
        self._cv = threading.Condition()
        self._inbox: collections.deque = collections.deque()
        self._stopping = False
        self.streams: dict[int, _Stream] = {}
        self._out: list[tuple["Job", Delivery]] = []  # noqa: F821
        self._acks_due = False  # a push left a stream with output to hand over but no hop to step
        self._lanes_gauge = metrics.lanes_in_use.labels(worker=str(index))
        self._worst_gauge = metrics.worst_lateness.labels(worker=str(index))

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
        live stream is ready; otherwise they run after the live streams' step in the same round,
        within the lanes and time the live streams leave (`_files`)."""
        ready_live, files, flushing, live = [], [], False, 0
        for st in self.streams.values():
            is_live = st.stepping_live
            live += is_live
            if st.se.ready_hops():
                if is_live:
                    ready_live.append(st)
                elif st.live:
                    flushing = True
                else:
                    files.append(st)
        if not ready_live:
            if flushing:
                return 0
            if not files:
                return None
            allowed, wait = self._files(files, False, time.perf_counter())
            return 0 if allowed else wait
        if self.max_wait <= 0 or len(ready_live) >= live:
            return 0
        remaining = min(st.ready_since for st in ready_live) + self.max_wait - time.perf_counter()
        return remaining if remaining > 0 else 0

    def _apply_one(self, cmd: Command) -> None:
        """Apply one command; a failure closes that command's stream only."""
        try:
            self._apply(cmd)
        except Exception as e:  # noqa: BLE001
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
            se = StreamCursor(self.enhancer.engine, job.sample_rate, job.channels, cmd.atten_lim_db, False,
                                   self.pool)
        except Exception as e:  # noqa: BLE001 - reported to the client, the worker goes on
            self._fail(job, e)
            return
        st = _Stream(job, se)
        self.streams[job.id] = st
        if st.live:
            self.live_lanes += se.channels
        self._lanes_gauge.set(self.pool.capacity - self.pool.n_free)

    def _push(self, st: "_Stream", cmd: Push) -> None:
        had = st.se.ready_hops()
        try:
            st.se.push(cmd.pcm, "audio")
        except Exception as e:  # noqa: BLE001
            self._fail(st.job, e)
            self._drop(st)
            return
        st.note_push(st.se.ready_hops() - had, cmd.arrived)
        st.acked, st.dirty = cmd.seq, True
        if not had:
            st.ready_since = time.perf_counter()
        if not st.se.ready_hops():
            self._acks_due = True

    def _end(self, st: "_Stream", cmd: End) -> None:
        st.se.begin_flush()
        st.flushing, st.dirty, st.acked = True, True, cmd.seq
        self._acks_due = True

    def _round(self) -> None:
        """One batched step over every live stream with a ready hop (a stream too late first skips
        its backlog, `_catch_up`; one behind the lateness budget with several ready hops runs them
        in a multi-frame call instead, `_run_backlog`), then one multi-frame call (`_run_file`) per
        flushing stream and per file that the live streams leave lanes and time for (`_files`)."""
        now = time.perf_counter()
        live, behind, flushing, files = [], [], [], []
        for st in self.streams.values():
            if not st.se.ready_hops():
                continue
            if st.stepping_live:
                self._catch_up(st, now)
                st.due = st.due_time(st.steps, self.hop_s)
                (behind if st.se.ready_hops() > 1 and now - st.due > self.late_s else live).append(st)
            elif st.live:
                flushing.append(st)
            else:
                files.append(st)
        self._round_live(live)
        for st in behind:
            if st.job.id in self.streams:
                self._run_backlog(st)
        frames = FILE_FRAMES_BESIDE_LIVE if any(st.stepping_live for st in self.streams.values()) else FILE_FRAMES
        for st in flushing + self._files(files, bool(live), time.perf_counter())[0]:
            if st.job.id in self.streams:
                self._run_file(st, frames)

    def _run_file(self, st: _Stream, frames: int) -> None:
        """Up to `frames` ready hops of one stream in one call (`LanePool.run`); a failure closes
        that stream only (the pool's state only changes when a call succeeds)."""
        se = st.se
        n = min(se.ready_hops(), frames)
        try:
            t0 = time.perf_counter()
            try:
                r = self.pool.run(se.lanes, se.take_hops(n), st.gain)
            finally:
                t1 = time.perf_counter()
                self._spend(t1 - t0, t1)
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

    def _run_backlog(self, st: _Stream) -> None:
        """A live stream later than the lateness budget with several ready hops (it fell behind,
        but not past `max_lateness_ms`): up to `BACKLOG_FRAMES` of them in one multi-frame call,
        which costs about what one batched step does, so the stream catches up in a few rounds;
        each hop's lateness is recorded."""
        first = st.steps
        self._run_file(st, BACKLOG_FRAMES)
        if st.job.id not in self.streams:
            return
        done = time.perf_counter()
        worst = 0.0
        for hop in range(first, st.steps):
            st.due = st.due_time(hop, self.hop_s)
            worst = max(worst, self._lateness(st, done))
        self._worst_gauge.set(worst)

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
        try:
            r = self.pool.step(lanes, np.concatenate(hops), gains)
        finally:
            t1 = time.perf_counter()
            self._spend(t1 - t0, t1)
        self.metrics.step_seconds.observe(t1 - t0)
        self.metrics.batch_size.observe(len(lanes))
        return r

    # ------------------------------------------------------------------ admission and lateness
    def _spend(self, seconds: float, now: float) -> None:
        self._refill(now)
        self._credit -= seconds

    def _refill(self, now: float) -> None:
        self._credit = min(self._credit + (now - self._credit_t) * self.duty, self.hop_s * self.duty)
        self._credit_t = now

    def _files(self, others: list[_Stream], with_live: bool, now: float) -> tuple[list[_Stream], float | None]:
        """The files (REST jobs) among `others` that may step now, and otherwise how long to
        wait before they may (None: until a command arrives). Beside live streams on this worker
        they use the lanes those leave within its capacity; in a step of their own, while live
        streams are served anywhere, only the duty-cycle credit (so the cores stay free for them)."""
        if not others:
            return [], None
        if not with_live and self._service_live():
            self._refill(now)
            if self._credit <= 0:
                return [], max(-self._credit / max(self.duty, 1e-3), 0.0005)
        if not self.live_lanes:
            return others, None
        room = max(self.capacity - self.live_lanes, 0)
        files = []
        for st in others:
            if st.se.channels <= room:
                files.append(st)
                room -= st.se.channels
        return files, None

    def _catch_up(self, st: _Stream, now: float) -> None:
        """A live stream whose oldest hop is later than `max_lateness_ms` skips all its ready hops
        but the newest: their output is zeros (sample alignment is kept) and the client gets a
        "gap" message naming the output samples that are not its enhanced input."""
        se = st.se
        k = se.ready_hops() - 1
        if k < 1 or now - st.due_time(st.steps, self.hop_s) <= self.skip_s:
            return
        lateness = now - st.due_time(st.steps, self.hop_s)
        start, samples = se.skip(k)
        st.steps += k
        st.skipped += k
        st.dirty = True
        st.events.append({"type": "gap", "start_sample": start, "samples": samples,
                          "skipped_ms": round(1000 * k * self.hop_s, 1), "lateness_ms": round(1000 * lateness, 1)})
        self.metrics.skipped_hops.inc(k)
        self.metrics.gaps.inc()
        log.warning("stream %d was %.0f ms late: skipped %d hop(s)", st.job.id, 1000 * lateness, k)

    def _lateness(self, st: _Stream, done: float) -> float:
        """Record how late a live hop was stepped (returned, s); tell the client when it falls
        behind the budget and when it is on time again."""
        late = max(done - st.due, 0.0)
        self.metrics.lateness.observe(late)
        if late > self.late_s:
            self.metrics.late_hops.inc()
            if not st.behind:
                st.behind = True
                self.metrics.behind.inc()
                st.events.append({"type": "late", "lateness_ms": round(1000 * late, 1),
                                  "budget_ms": round(1000 * self.late_s, 1),
                                  "max_lateness_ms": round(1000 * self.skip_s, 1)})
        elif st.behind and late <= self.late_s / 2:
            st.behind = False
            st.events.append({"type": "on_time", "lateness_ms": round(1000 * late, 1)})
        return late

    def _scatter(self, group: list[_Stream], r) -> None:
        """Hand each stream its slice of a step's result (a stream whose bookkeeping fails is
        closed alone)."""
        o = 0
        counts = collections.Counter()
        done = time.perf_counter()
        worst = None
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
                if st.stepping_live:
                    late = self._lateness(st, done)
                    worst = late if worst is None else max(worst, late)
            o += c
        if worst is not None:
            self._worst_gauge.set(worst)
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
            audio, final = se.pull(), False
        frames, st.frames = st.frames, []
        events, st.events = st.events, []
        acked = st.acked if drained else 0
        self._out.append((st.job, Delivery(audio, frames, acked, final, events=events)))
        if final:
            self._drop(st)

    def _fail(self, job: "Job", e: Exception, internal: bool = False) -> None:  # noqa: F821
        if isinstance(e, AudioError) and not internal:
            err = ServiceError("invalid_audio", str(e))
        else:
            err = ServiceError("internal", "inference failed; the stream was closed")
        self._out.append((job, Delivery(np.zeros((0, job.channels), np.float32), [], job.sent, True, err)))
        self._post()

    def _drop(self, st: _Stream) -> None:
        if self.streams.pop(st.job.id, None) is not None and st.live:
            self.live_lanes -= st.se.channels
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
