"""Lateness of live streams: when each hop is due, how late it was stepped, what the client is
told about it, and when a stream skips its backlog instead of falling further behind.

A live hop is due at max(arrival of the push that completed it, first arrival + its index x hop):
a client sending faster than real time is never late. A hop stepped later than
`lateness_budget_ms` after it was due makes the client get a `Late` event (once per episode, then
`OnTime` when it is back under half the budget). A stream whose oldest ready hop is later than
`max_lateness_ms` skips all its ready hops but the newest: their output is zeros, sample alignment
is kept, and the client gets a `Gap` event naming the output samples that are not its enhanced input.
"""
from __future__ import annotations

import logging

from server.messages import Gap, Late, OnTime
from server.metrics import Metrics
from server.scheduling.streams import StreamState
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

    def behind(self, st: StreamState, now: float) -> bool:
        """Set the due time of the stream's next hop; True when it has several ready hops and that
        one is already later than the budget (its backlog then runs in multi-frame calls)."""
        st.due = st.arrivals.due_time(st.steps, self.hop_s)
        return st.cursor.ready_hops() > 1 and now - st.due > self.late_s

    def catch_up(self, st: StreamState, now: float) -> None:
        """Skip the stream's ready hops but the newest when its oldest is later than `max_lateness_ms`."""
        cursor = st.cursor
        k = cursor.ready_hops() - 1
        if k < 1:
            return
        lateness = now - st.arrivals.due_time(st.steps, self.hop_s)
        if lateness <= self.skip_s:
            return
        start, samples = cursor.skip(k)
        st.dirty = True
        st.events.append(Gap(start, samples, round(1000 * k * self.hop_s, 1), round(1000 * lateness, 1)))
        self.metrics.skipped_hops.inc(k)
        self.metrics.gaps.inc()
        log.warning("stream %d was %.0f ms late: skipped %d hop(s)", st.job.id, 1000 * lateness, k)

    def observe(self, st: StreamState, done: float) -> float:
        """Record how late the stream's current hop was stepped (returned, s); tell the client when
        it falls behind the budget and when it is on time again."""
        late = max(done - st.due, 0.0)
        self.metrics.lateness.observe(late)
        if late > self.late_s:
            self.metrics.late_hops.inc()
            if not st.behind:
                st.behind = True
                self.metrics.behind.inc()
                st.events.append(Late(round(1000 * late, 1), round(1000 * self.late_s, 1), round(1000 * self.skip_s, 1)))
        elif st.behind and late <= self.late_s / 2:
            st.behind = False
            st.events.append(OnTime(round(1000 * late, 1)))
        return late

    def observe_backlog(self, st: StreamState, first: int, done: float) -> None:
        """Record the lateness of hops [first, steps) of a stream, all stepped at `done`."""
        worst = 0.0
        for hop in range(first, st.steps):
            st.due = st.arrivals.due_time(hop, self.hop_s)
            worst = max(worst, self.observe(st, done))
        self.report_worst(worst)

    def report_worst(self, worst: float) -> None:
        """The lateness of the stream furthest behind in the last step."""
        self._worst_gauge.set(worst)
