"""The batching round of an inference worker: gather every live job's ready hop, step them in one
call of the lane pool, hand each job its rows; then one multi-frame call per group of flushing
jobs and per file that the live jobs leave room for.

Every call is `Batcher.call`: a group of jobs and a frame count T, their hops taken (k, T, hop),
one `LanePool.run` over all of them through `server.scheduling.calls.run_parts` (and its one retry
policy), each job's rows handed back to its cursor. A live hop is such a call with T = 1.

Files run up to `FILE_FRAMES` hops per call (every weight read once per chunk), or
`FILE_FRAMES_BESIDE_LIVE` while live jobs share the worker, so that a file never holds a live hop
back for long. Live jobs behind the lateness budget run their backlogs up to `BACKLOG_FRAMES` hops
per call, all of them in one call, instead of one hop per round (`server.scheduling.lateness`);
jobs that end together flush together.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from enhancer.pools import LanePoolProtocol
from enhancer.runtime import OFFLINE_FRAMES, StepResult
from server.metrics import Metrics
from server.scheduling.calls import Part, run_parts
from server.scheduling.duty import FileShare
from server.scheduling.jobs import Job
from server.scheduling.lateness import LatenessPolicy

FILE_FRAMES = OFFLINE_FRAMES  # hops per call of a file's backlog when no live job shares the worker
FILE_FRAMES_BESIDE_LIVE = 4  # ... when live jobs do: such a call costs about one batched live step
BACKLOG_FRAMES = 16  # hops per call of a live job's backlog (it is late: it gets a larger share)

log = logging.getLogger("tim_enhancer.server")


def lane_clusters(group: list[Job], slack: int = 4) -> list[list[Job]]:
    """`group` split, in lane order, into runs whose calls waste little: `LanePool.run` computes
    every lane between the lowest and the highest it steps, so a run grows only while its lane
    range stays within twice its lanes plus `slack`."""
    if len(group) < 2:
        return [group] if group else []
    order = sorted(group, key=lambda job: int(job.cursor.lanes.min()))
    parts, part, lo, hi, used = [], [], 0, 0, 0
    for job in order:
        lanes = job.cursor.lanes
        a, b, k = int(lanes.min()), int(lanes.max()) + 1, len(lanes)
        if part and max(hi, b) - lo > 2 * (used + k) + slack:
            parts.append(part)
            part = []
        if not part:
            lo, hi, used = a, b, 0
        part.append(job)
        hi, used = max(hi, b), used + k
    parts.append(part)
    return parts


class Batcher:
    """Rounds over a worker's jobs (its thread only). `fail(job, e)` closes a job whose inference or
    bookkeeping failed. `timings`, when set, gets (lanes, seconds) of every batched live step (the
    capacity follows them: server.scheduling.capacity.CapacityTracker)."""

    timings = None

    def __init__(self, pool: LanePoolProtocol, jobs: dict[int, Job], metrics: Metrics, lateness: LatenessPolicy,
                 files: FileShare, max_wait_s: float, fail: Callable[[Job, Exception], None]):
        self.pool, self.jobs, self.metrics = pool, jobs, metrics
        self.lateness, self.files = lateness, files
        self.max_wait = max_wait_s  # longest a ready hop waits for other live jobs to join its step
        self.fail = fail

    def wait(self) -> float | None:
        """Seconds to hold the next step so that more live jobs join it (0: step now, None: nothing
        to step). A step waits until every live job has a hop ready, or until the oldest ready hop
        has waited `max_wait`: big batches cost far less per job than small ones, and a live job
        needs only one step per hop. Files and flushing jobs never wait when no live job is ready;
        otherwise they run after the live jobs' step in the same round, within the lanes and time
        the live jobs leave (`FileShare`)."""
        ready_live, files, flushing, live = [], [], False, 0
        for job in self.jobs.values():
            is_live = job.stepping_live
            live += is_live
            if job.cursor.ready_hops():
                if is_live:
                    ready_live.append(job)
                elif job.live:
                    flushing = True
                else:
                    files.append(job)
        if not ready_live:
            if flushing:
                return 0
            if not files:
                return None
            allowed, wait = self.files.allowed(files, False, time.perf_counter())
            return 0 if allowed else wait
        if self.max_wait <= 0 or len(ready_live) >= live:
            return 0
        remaining = min(job.ready_since for job in ready_live) + self.max_wait - time.perf_counter()
        return remaining if remaining > 0 else 0

    def round(self) -> None:
        """One batched step over every live job with a ready hop (a job too late first skips its
        backlog; one behind the lateness budget with several ready hops runs them in a multi-frame
        call instead, `run_backlog`), then one multi-frame call per group of flushing jobs and per
        file (`run_file`) that the live jobs leave lanes and time for."""
        now = time.perf_counter()
        live, behind, flushing, files = [], [], [], []
        for job in self.jobs.values():
            if not job.cursor.ready_hops():
                continue
            if job.stepping_live:
                self.lateness.catch_up(job, now)
                (behind if self.lateness.behind(job, now) else live).append(job)
            elif job.live:
                flushing.append(job)
            else:
                files.append(job)
        self.call(live, 1, live=True)
        if behind:
            self.run_backlog(behind)
        if flushing:  # a tail is a few hops (the model's delay): all of them in one call
            self.run_group(flushing, BACKLOG_FRAMES)
        allowed = self.files.allowed(files, bool(live), time.perf_counter())[0]
        if allowed:
            frames = FILE_FRAMES_BESIDE_LIVE if any(job.stepping_live for job in self.jobs.values()) else FILE_FRAMES
            for job in allowed:
                self.run_file(job, frames)

    def run_file(self, job: Job, frames: int) -> None:
        """Up to `frames` ready hops of one file in one call; a failure closes that file only."""
        self.run_group([job], frames)

    def run_group(self, group: list[Job], frames: int) -> None:
        """Up to `frames` ready hops of every job of `group` still held, in one call per cluster of
        lanes (`lane_clusters`). Jobs that fall behind or end together run together: one call over
        ten jobs costs a third to a half of what ten calls of one do."""
        for cluster in lane_clusters([job for job in group if job.id in self.jobs]):
            self.call(cluster, frames)

    def run_backlog(self, behind: list[Job]) -> None:
        """Live jobs later than the lateness budget with several ready hops (they fell behind, but
        not past `max_lateness_ms`): up to `BACKLOG_FRAMES` of their hops in one multi-frame call
        for all of them (`run_group`), which costs a few batched steps, so they catch up in a few
        rounds without holding the others back; each hop's lateness is recorded."""
        first = {job.id: job.steps for job in behind}
        self.run_group(behind, BACKLOG_FRAMES)
        done = time.perf_counter()
        for job in behind:
            if job.id in self.jobs:
                self.lateness.observe_backlog(job, first[job.id], done)

    def call(self, group: list[Job], frames: int, live: bool = False) -> None:
        """The one path of a hop: up to `frames` ready hops of every job of `group`, the same number
        for each (the fewest any of them has ready; the rest go in the next round), in one
        `LanePool.run` through `run_parts`: if it fails, each job is run alone, so a fault tied to
        one job closes that job only and a transient one closes none. `live`: the round's live
        step (one hop each): it is timed for the capacity and each job's lateness is observed."""
        if not group:
            return
        n = min(min(job.cursor.ready_hops() for job in group), frames)
        parts = []
        for job in group:
            try:
                parts.append(Part(job, job.cursor.lanes, job.cursor.take_hops(n), job.cursor.gains))
            except Exception as e:  # this job's bookkeeping: close it alone
                log.exception("job %d: taking %d hop(s) failed: closing it", job.id, n)
                self.fail(job, e)
        c = _Call(self, live)
        run_parts(c.run, parts, c.done, c.failed)
        c.report()


class _Call:
    """One `Batcher.call`: the timed call of the pool, each job's rows handed back, and what the
    call measures (`files.spend`, `batch_size`, frames by source; for the live step also
    `step_seconds`, the worker's `timings` and the worst lateness)."""

    def __init__(self, batcher: Batcher, live: bool):
        self.b, self.live = batcher, live
        self.ended = 0.0  # when the last call of the pool returned
        self.frames: dict[str, int] = {}  # frames stepped by source
        self.worst: float | None = None  # the live step's worst lateness

    def run(self, lanes: np.ndarray, hops: np.ndarray, gains: np.ndarray) -> StepResult:
        b = self.b
        t0 = time.perf_counter()
        try:
            r = b.pool.run(lanes, hops, gains)
        finally:
            self.ended = time.perf_counter()
            b.files.spend(self.ended - t0, self.ended)
        b.metrics.batch_size.observe(len(lanes))
        if self.live:
            b.metrics.step_seconds.observe(self.ended - t0)
            if b.timings is not None:
                b.timings.append((len(lanes), self.ended - t0))
        return r

    def done(self, part: Part, r: StepResult) -> None:
        job, b = part.owner, self.b
        try:
            job.cursor.put_outputs(r.out, r.competition, r.activity)
        except Exception as e:  # a fault of this job's bookkeeping: close it alone
            log.exception("job %d: output bookkeeping failed", job.id)
            b.fail(job, e)
            return
        job.dirty = True
        self.frames[job.source] = self.frames.get(job.source, 0) + r.out.shape[1]
        if self.live:
            late = b.lateness.observe(job, self.ended)
            self.worst = late if self.worst is None else max(self.worst, late)
        if job.cursor.ready_hops():  # a hop left over counts as ready from now (a backlog of one chunk is no delay)
            job.ready_since = time.perf_counter()

    def failed(self, part: Part, e: Exception) -> None:
        job = part.owner
        log.error("job %d: inference of %d hop(s) failed alone: closing it", job.id, part.hops.shape[1], exc_info=e)
        self.b.fail(job, e)

    def report(self) -> None:
        b = self.b
        if self.worst is not None:
            b.lateness.report_worst(self.worst)
        for source, n in self.frames.items():
            b.metrics.frames.labels(source=source).inc(n)
