"""A worker's state for one job (`StreamState`): its cursor, what to deliver next, and when its
hops arrived (`Arrivals`, for the lateness of live streams)."""
from __future__ import annotations

import collections

from enhancer.cursor import StreamCursor
from server.messages import Event, Source
from server.scheduling.commands import JobHandle


class Arrivals:
    """When a live stream's hops arrived, to tell when each one is due."""

    __slots__ = ("first_arrival", "hops_in", "pushes")

    def __init__(self):
        self.pushes: collections.deque = collections.deque()  # (hops_in after a push, its arrival time)
        self.hops_in = 0  # hops made ready by pushes so far
        self.first_arrival: float | None = None

    def note_push(self, new_hops: int, t: float) -> None:
        if new_hops > 0:
            self.hops_in += new_hops
            self.pushes.append((self.hops_in, t))
            if self.first_arrival is None:
                self.first_arrival = t

    def due_time(self, hop: int, hop_s: float) -> float:
        """When hop `hop` (stream index) could first have been stepped by a real-time server."""
        while self.pushes and self.pushes[0][0] <= hop:
            self.pushes.popleft()
        arrival = self.pushes[0][1] if self.pushes else 0.0
        return max(arrival, (self.first_arrival or 0.0) + hop * hop_s)


class StreamState:
    """A worker's state for one job (its thread only)."""

    __slots__ = (
        "acked",
        "arrivals",
        "behind",
        "cursor",
        "dirty",
        "due",
        "events",
        "flushing",
        "job",
        "live",
        "ready_since",
    )

    def __init__(self, job: JobHandle, cursor: StreamCursor):
        self.job, self.cursor = job, cursor
        self.acked = 0  # sequence number of the last push to acknowledge
        self.flushing = False
        self.dirty = False  # has output or an acknowledgement to deliver
        self.ready_since = 0.0  # when its oldest ready hop became ready (perf_counter)
        self.live = job.source == Source.STREAM
        self.arrivals = Arrivals()
        self.due = 0.0  # due time of the hop in the current round
        self.behind = False  # told the client it is late, not yet that it is on time again
        self.events: list[Event] = []  # for the client, delivered with the next output

    @property
    def stepping_live(self) -> bool:
        return self.live and not self.flushing

    @property
    def steps(self) -> int:
        """Hops stepped or skipped so far (the index of the next hop)."""
        return self.cursor.hops_out

    @property
    def channels(self) -> int:
        return self.cursor.channels
