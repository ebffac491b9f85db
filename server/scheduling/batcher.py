"""The batching round of an inference worker: gather every live stream's ready hop, step them in
one call of the lane pool, hand each stream its slice; then one multi-frame call per flushing
group of flushing streams and per file that the live streams leave room for.

Files run up to `FILE_FRAMES` hops per call (`LanePool.run`: every weight read once per chunk),
or `FILE_FRAMES_BESIDE_LIVE` while live streams share the worker, so that a file never holds a
live hop back for long. Live streams behind the lateness budget run their backlogs up to
`BACKLOG_FRAMES` hops per call, all of them in one call, instead of one hop per round
(`server.scheduling.lateness`); streams that end together flush together.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from enhancer.runtime import OFFLINE_FRAMES, LanePool, StepResult
from server.metrics import Metrics
from server.scheduling.duty import FileShare
from server.scheduling.lateness import LatenessPolicy
from server.scheduling.streams import StreamState

FILE_FRAMES = OFFLINE_FRAMES  # hops per call of a file's backlog when no live stream shares the worker
FILE_FRAMES_BESIDE_LIVE = 4  # ... when live streams do: such a call costs about one batched live step
BACKLOG_FRAMES = 16  # hops per call of a live stream's backlog (it is late: it gets a larger share)

log = logging.getLogger("tim_enhancer.server")


def lane_clusters(group: list[StreamState], slack: int = 4) -> list[list[StreamState]]:
    """`group` split, in lane order, into runs whose calls waste little: `LanePool.run` computes
    every lane between the lowest and the highest it steps, so a run grows only while its lane
    range stays within twice its lanes plus `slack`."""
    if len(group) < 2:
        return [group] if group else []
    order = sorted(group, key=lambda st: int(st.cursor.lanes.min()))
    parts, part, lo, hi, used = [], [], 0, 0, 0
    for st in order:
        lanes = st.cursor.lanes
        a, b, k = int(lanes.min()), int(lanes.max()) + 1, len(lanes)
        if part and max(hi, b) - lo > 2 * (used + k) + slack:
            parts.append(part)
            part = []
        if not part:
            lo, hi, used = a, b, 0
        part.append(st)
        hi, used = max(hi, b), used + k
    parts.append(part)
    return parts


class _CallFailed(Exception):
    """A `LanePool.run` call failed (the cause is chained)."""


class Batcher:
    """Rounds over a worker's streams (its thread only). `fail(st, e)` closes a stream whose
    inference or bookkeeping failed. `timings`, when set, gets (lanes, seconds) of every batched live
    step (the capacity follows them: server.scheduling.capacity.CapacityTracker)."""

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
        if behind:
            self.run_backlog(behind)
        if flushing:  # a tail is a few hops (the model's delay): all of them in one call
            self.run_group(flushing, BACKLOG_FRAMES)
        allowed = self.files.allowed(files, bool(live), time.perf_counter())[0]
        if allowed:
            frames = FILE_FRAMES_BESIDE_LIVE if any(st.stepping_live for st in self.streams.values()) else FILE_FRAMES
            for st in allowed:
                if st.job.id in self.streams:
                    self.run_file(st, frames)

    def run_file(self, st: StreamState, frames: int) -> None:
        """Up to `frames` ready hops of one stream in one call (`LanePool.run`); a failure closes
        that stream only (the pool's state only changes when a call succeeds)."""
        self.run_group([st], frames)

    def run_group(self, group: list[StreamState], frames: int) -> None:
        """Up to `frames` ready hops of every stream of `group` in one call (`LanePool.run`), the
        same number for each: the fewest any of them has ready (the rest go in the next round).
        Streams that fall behind or end together run together: one call over ten streams costs
        a third to a half of what ten calls of one do. If the call fails, each stream is retried alone with the
        hops it gave (the pool's state only changes when a call succeeds), so a fault tied to one
        stream closes that stream only."""
        group = [st for st in group if st.job.id in self.streams]
        parts = lane_clusters(group)
        if len(parts) > 1:
            for part in parts:
                self.run_group(part, frames)
            return
        if not group:
            return
        n = min(min(st.cursor.ready_hops() for st in group), frames)
        taken: list[tuple[StreamState, np.ndarray]] = []
        for st in group:
            try:
                taken.append((st, st.cursor.take_hops(n)))
            except Exception as e:  # this stream's bookkeeping: close it alone
                log.exception("stream %d: taking %d hop(s) failed: closing it", st.job.id, n)
                self.fail(st, e)
        if not taken:
            return
        try:
            r = self._run_hops(taken)
        except _CallFailed as e:
            if len(taken) == 1:
                log.error("inference of %d hop(s) of stream %d failed: closing it", n, taken[0][0].job.id,
                          exc_info=e.__cause__)
                self.fail(taken[0][0], e.__cause__)
                return
            log.error("inference of %d hop(s) of %d streams failed; retrying them one by one", n, len(taken),
                      exc_info=e.__cause__)
            for st, hops in taken:
                try:
                    r = self._run_hops([(st, hops)])
                except _CallFailed as e:
                    log.error("inference of %d hop(s) of stream %d failed: closing it (%s)", n, st.job.id,
                              type(e.__cause__).__name__)
                    self.fail(st, e.__cause__)
                    continue
                self._put_many([(st, hops)], r)
            return
        self._put_many(taken, r)

    def _run_hops(self, taken: list[tuple[StreamState, np.ndarray]]) -> StepResult:
        """One `LanePool.run` over the streams' taken hops (channels, n, hop) each; _CallFailed on failure."""
        lanes = np.concatenate([st.cursor.lanes for st, _ in taken])
        gains = np.concatenate([st.cursor.gains for st, _ in taken])
        t0 = time.perf_counter()
        try:
            r = self.pool.run(lanes, np.concatenate([h for _, h in taken]), gains)
        except Exception as e:
            raise _CallFailed() from e
        finally:
            t1 = time.perf_counter()
            self.files.spend(t1 - t0, t1)
        self.metrics.batch_size.observe(len(lanes))
        return r

    def _put_many(self, taken: list[tuple[StreamState, np.ndarray]], r: StepResult) -> None:
        """Hand each stream its lanes' slice of a multi-frame call's result."""
        o = 0
        now = time.perf_counter()
        for st, hops in taken:
            c = st.cursor
            k = c.channels
            try:
                comp = None if r.competition is None else r.competition[o:o + k]
                c.put_outputs(r.out[o:o + k], comp, None if r.activity is None else r.activity[o:o + k])
            except Exception as e:  # a fault of this stream's bookkeeping: close it alone
                log.exception("stream %d: output bookkeeping failed", st.job.id)
                self.fail(st, e)
            else:
                st.dirty = True
                self.metrics.frames.labels(source=st.job.source).inc(hops.shape[1])
                if c.ready_hops():
                    st.ready_since = now
            o += k

    def run_backlog(self, behind: list[StreamState]) -> None:
        """Live streams later than the lateness budget with several ready hops (they fell behind,
        but not past `max_lateness_ms`): up to `BACKLOG_FRAMES` of their hops in one multi-frame
        call for all of them (`run_group`), which costs a few batched steps, so they catch up in a
        few rounds without holding the others back; each hop's lateness is recorded."""
        first = {st.job.id: st.steps for st in behind}
        self.run_group(behind, BACKLOG_FRAMES)
        done = time.perf_counter()
        for st in behind:
            if st.job.id in self.streams:
                self.lateness.observe_backlog(st, first[st.job.id], done)

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
