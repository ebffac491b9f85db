"""Lateness of live jobs (websocket streams): when each hop is due, how late it was stepped, what
the client is told about it, and when a live job skips its backlog instead of falling further
behind.

A live hop is due at max(arrival of the push that completed it, first arrival + its index x hop):
a client sending faster than real time is never late. A hop stepped later than
`lateness_budget_ms` after it was due makes the client get a `Late` event (once per episode, then
`OnTime` when it is back under half the budget). A live job whose oldest ready hop is later than
`max_lateness_ms` skips all its ready hops but the newest: their output is zeros, sample alignment
is kept, and the client gets a `Gap` event naming the output samples that are not its enhanced input.
"""
from __future__ import annotations

import logging

from server.messages import Gap, Late, OnTime
from server.metrics import Metrics
from server.scheduling.jobs import Job
from server.settings import Settings

log = logging.getLogger("tim_enhancer.server")


class LatenessPolicy:
    """One worker's lateness bookkeeping and catch-up decisions (its thread only)."""

    def __init__(self, settings: Settings, hop_s: float, metrics: Metrics, worker: str):
        self.hop_s = hop_s
        self.late_s = settings.lateness_budget_ms / 1000  # a hop stepped later than this: tell the client
        self.skip_s = settings.max_lateness_ms / 1000  # an oldest hop waiting longer than this: skip the backlog
        self.metrics = metrics
        self._worst_gauge = metrics.worst_lateness.labels(worker=worker)

    def behind(self, job: Job, now: float) -> bool:
        """Set the due time of the job's next hop; True when it has several ready hops and that
        one is already later than the budget (its backlog then runs in multi-frame calls)."""
        job.due = job.arrivals.due_time(job.steps, self.hop_s)
        return job.cursor.ready_hops() > 1 and now - job.due > self.late_s

    def catch_up(self, job: Job, now: float) -> None:
        """Skip the job's ready hops but the newest when its oldest is later than `max_lateness_ms`."""
        cursor = job.cursor
        k = cursor.ready_hops() - 1
        if k < 1:
            return
        lateness = now - job.arrivals.due_time(job.steps, self.hop_s)
        if lateness <= self.skip_s:
            return
        start, samples = cursor.skip(k)
        job.dirty = True
        job.events.append(Gap(start, samples, round(1000 * k * self.hop_s, 1), round(1000 * lateness, 1)))
        self.metrics.skipped_hops.inc(k)
        self.metrics.gaps.inc()
        log.warning("job %d was %.0f ms late: skipped %d hop(s)", job.id, 1000 * lateness, k)

    def observe(self, job: Job, done: float) -> float:
        """Record how late the job's current hop was stepped (returned, s); tell the client when
        it falls behind the budget and when it is on time again."""
        late = max(done - job.due, 0.0)
        self.metrics.lateness.observe(late)
        if late > self.late_s:
            self.metrics.late_hops.inc()
            if not job.behind:
                job.behind = True
                self.metrics.behind.inc()
                job.events.append(Late(round(1000 * late, 1), round(1000 * self.late_s, 1), round(1000 * self.skip_s, 1)))
        elif job.behind and late <= self.late_s / 2:
            job.behind = False
            job.events.append(OnTime(round(1000 * late, 1)))
        return late

    def observe_backlog(self, job: Job, first: int, done: float) -> None:
        """Record the lateness of hops [first, steps) of a job, all stepped at `done`."""
        worst = 0.0
        for hop in range(first, job.steps):
            job.due = job.arrivals.due_time(hop, self.hop_s)
            worst = max(worst, self.observe(job, done))
        self.report_worst(worst)

    def report_worst(self, worst: float) -> None:
        """The lateness of the job furthest behind in the last step."""
        self._worst_gauge.set(worst)
