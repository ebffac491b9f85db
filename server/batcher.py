"""The batching round of an inference worker: gather every live stream's ready hop, step them in
one call of the lane pool, hand each stream its slice; then one multi-frame call per flushing
stream and per file that the live streams leave room for.

Files run up to `FILE_FRAMES` hops per call (`LanePool.run`: every weight read once per chunk),
or `FILE_FRAMES_BESIDE_LIVE` while live streams share the worker, so that a file never holds a
live hop back for long. A live stream behind the lateness budget runs its backlog up to
`BACKLOG_FRAMES` hops per call instead of one hop per round (`server.lateness`).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from enhancer.runtime import OFFLINE_FRAMES, LanePool, StepResult

from .duty import FileShare
from .lateness import LatenessPolicy
from .metrics import Metrics
from .streams import StreamState

FILE_FRAMES = OFFLINE_FRAMES  # hops per call of a file's backlog when no live stream shares the worker
FILE_FRAMES_BESIDE_LIVE = 4  # ... when live streams do: such a call costs about one batched live step
BACKLOG_FRAMES = 16  # hops per call of a live stream's backlog (it is late: it gets a larger share)

log = logging.getLogger("tim_enhancer.server")


class Batcher:
    """Rounds over a worker's streams (its thread only). `fail(st, e)` closes a stream whose
    inference or bookkeeping failed. `timings`, when set, gets (lanes, seconds) of every batched live
    step (the capacity follows them: server.capacity.CapacityTracker)."""

    timings = None

    def __init__(self, pool: LanePool, streams: dict[int, StreamState], metrics: Metrics, lateness: LatenessPolicy,
                 files: FileShare, max_wait_s: float, fail: Callable[[StreamState, Exception], None]):
        self.pool, self.streams, self.metrics = pool, streams, metrics
        self.lateness, self.files = lateness, files
        self.max_wait = max_wait_s  # longest a ready hop waits for other streams to join its step
        self.fail = fail

    def wait(self) -> float | None:
        """Seconds to hold the next step so that more live streams join it (0: step now, None:
        nothing to step). A step waits until every live stream has a hop ready, or until the oldest
        ready hop has waited `max_wait`: big batches cost far less per stream than small ones, and
        a live stream needs only one step per hop. Files and flushing streams never wait when no
        live stream is ready; otherwise they run after the live streams' step in the same round,
        within the lanes and time the live streams leave (`FileShare`)."""
        ready_live, files, flushing, live = [], [], False, 0
        for st in self.streams.values():
            is_live = st.stepping_live
            live += is_live
            if st.cursor.ready_hops():
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
            allowed, wait = self.files.allowed(files, False, time.perf_counter())
            return 0 if allowed else wait
        if self.max_wait <= 0 or len(ready_live) >= live:
            return 0
        remaining = min(st.ready_since for st in ready_live) + self.max_wait - time.perf_counter()
        return remaining if remaining > 0 else 0

    def round(self) -> None:
        """One batched step over every live stream with a ready hop (a stream too late first skips
        its backlog; one behind the lateness budget with several ready hops runs them in a
        multi-frame call instead, `run_backlog`), then one multi-frame call (`run_file`) per
        flushing stream and per file that the live streams leave lanes and time for."""
        now = time.perf_counter()
        live, behind, flushing, files = [], [], [], []
        for st in self.streams.values():
            if not st.cursor.ready_hops():
                continue
            if st.stepping_live:
                self.lateness.catch_up(st, now)
                (behind if self.lateness.behind(st, now) else live).append(st)
            elif st.live:
                flushing.append(st)
            else:
                files.append(st)
        self._step_live(live)
        for st in behind:
            if st.job.id in self.streams:
                self.run_backlog(st)
        frames = FILE_FRAMES_BESIDE_LIVE if any(st.stepping_live for st in self.streams.values()) else FILE_FRAMES
        for st in flushing + self.files.allowed(files, bool(live), time.perf_counter())[0]:
            if st.job.id in self.streams:
                self.run_file(st, frames)

    def run_file(self, st: StreamState, frames: int) -> None:
        """Up to `frames` ready hops of one stream in one call (`LanePool.run`); a failure closes
        that stream only (the pool's state only changes when a call succeeds)."""
        c = st.cursor
        n = min(c.ready_hops(), frames)
        try:
            t0 = time.perf_counter()
            try:
                r = self.pool.run(c.lanes, c.take_hops(n), c.gains)
            finally:
                t1 = time.perf_counter()
                self.files.spend(t1 - t0, t1)
            self.metrics.batch_size.observe(len(c.lanes))
            c.put_outputs(r.out, r.competition, r.activity)
        except Exception as e:  # a fault of this stream's call: close it, keep serving the others
            log.exception("inference of %d hop(s) of stream %d failed: closing it", n, st.job.id)
            self.fail(st, e)
            return
        st.dirty = True
        self.metrics.frames.labels(source=st.job.source).inc(n)
        if c.ready_hops():
            st.ready_since = time.perf_counter()

    def run_backlog(self, st: StreamState) -> None:
        """A live stream later than the lateness budget with several ready hops (it fell behind,
        but not past `max_lateness_ms`): up to `BACKLOG_FRAMES` of them in one multi-frame call,
        which costs about what one batched step does, so the stream catches up in a few rounds;
        each hop's lateness is recorded."""
        first = st.steps
        self.run_file(st, BACKLOG_FRAMES)
        if st.job.id in self.streams:
            self.lateness.observe_backlog(st, first, time.perf_counter())

    def _step_live(self, ready: list[StreamState]) -> None:
        """One batched step over the live streams with a ready hop. If the batched call fails, each
        stream is retried alone (the pool's state only changes when a step succeeds), so a fault
        tied to one stream closes that stream only and a transient one closes none."""
        if not ready:
            return
        hops = [st.cursor.take_hop() for st in ready]  # (channels, hop) each
        try:
            r = self._step(ready, hops)
        except Exception:  # retried one stream at a time below
            log.exception("inference step of %d stream(s) failed; retrying them one by one", len(ready))
            for st, hop in zip(ready, hops):
                try:
                    r = self._step([st], [hop])
                except Exception as e:  # this stream's fault: close it alone
                    log.error("inference step failed again for stream %d alone: closing it (%s)", st.job.id,
                              type(e).__name__)
                    self.fail(st, e)
                    continue
                self._scatter([st], r)
            return
        self._scatter(ready, r)

    def _step(self, group: list[StreamState], hops: list[np.ndarray]) -> StepResult:
        lanes = np.concatenate([st.cursor.lanes for st in group])
        gains = np.concatenate([st.cursor.gains for st in group])
        t0 = time.perf_counter()
        try:
            r = self.pool.step(lanes, np.concatenate(hops), gains)
        finally:
            t1 = time.perf_counter()
            self.files.spend(t1 - t0, t1)
        self.metrics.step_seconds.observe(t1 - t0)
        self.metrics.batch_size.observe(len(lanes))
        if self.timings is not None:
            self.timings.append((len(lanes), t1 - t0))
        return r

    def _scatter(self, group: list[StreamState], r: StepResult) -> None:
        """Hand each stream its slice of a step's result (a stream whose bookkeeping fails is
        closed alone)."""
        o = 0
        counts: dict[str, int] = {}
        done = time.perf_counter()
        worst = None
        for st in group:
            c = st.cursor.channels
            try:
                comp = None if r.competition is None else r.competition[o:o + c]
                st.cursor.put_output(r.out[o:o + c], comp, r.activity[o:o + c])
            except Exception as e:  # a fault of this stream's bookkeeping: close it alone
                log.exception("stream %d: output bookkeeping failed", st.job.id)
                self.fail(st, e)
            else:
                st.dirty = True
                counts[st.job.source] = counts.get(st.job.source, 0) + 1
                if st.stepping_live:
                    late = self.lateness.observe(st, done)
                    worst = late if worst is None else max(worst, late)
            o += c
        if worst is not None:
            self.lateness.report_worst(worst)
        for source, n in counts.items():
            self.metrics.frames.labels(source=source).inc(n)
        now = time.perf_counter()
        for st in group:  # a hop left over counts as ready from now (a backlog of one chunk is no delay)
            if st.job.id in self.streams and st.cursor.ready_hops():
                st.ready_since = now
