"""One admitted stream or file: a `Job`, the one object both threads hold for it, and what the
event loop and the job's inference worker hand each other about it.

The event loop (a websocket or REST handler) enqueues commands (`Open`, `Push`, `End`, `Close`) to
the worker, which applies them in order on its thread (`server.scheduling.worker`); the worker's
`Delivery`s come back through the job's event loop, in order. A job is live (a websocket stream,
`Source.STREAM`) or a file (a REST upload, `Source.REST`).

Each field of a `Job` is owned by one thread: its parameters are set at construction and only
read after; the event-loop side (queue, sent, in_flight, buffered, acknowledged, ended, closed)
is read and written on the event loop only; the worker side (cursor, acked, arrivals, due,
behind, events, dirty, ready_since, flushing) on the worker's thread only, once the job is opened.
The two sides meet only through the commands and the deliveries: `sent` numbers the pushes, the
worker's `acked` comes back in `Delivery.acked`, and each is kept once.
"""
from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from enhancer.cursor import StepFrame, StreamCursor
from server.errors import ServiceError
from server.messages import Event, Source
from server.scheduling.admission import LaneLedger


@dataclass
class Delivery:
    """Output of a job handed to its handler: audio (n, channels) float32 at the job's rate."""

    audio: np.ndarray
    frames: list[StepFrame] = field(default_factory=list)  # per-step metadata (with "metadata": true)
    acked: int = 0  # sequence number of the last push whose audio is fully processed
    final: bool = False  # the job's tail after `end`, or its error; nothing follows
    error: ServiceError | None = None
    events: list[Event] = field(default_factory=list)  # for the client: Late, OnTime, Gap
    state: bytes | None = None  # with the final delivery of a suspended job: its state (`StreamCursor.state_bytes`)


@dataclass(frozen=True)
class Open:
    """Start an admitted job (its lanes are reserved)."""

    job: Job
    atten_lim_db: float | None
    band: str = "full"  # "full": the band above 8 kHz kept (above 16 kHz); "speech": up to 8 kHz
    level: str = "model"  # "model": the model's output level; "input": the voice at the input's speech level
    state: bytes | None = None  # a suspended stream's state to continue (`StreamCursor.load_state_bytes`)


@dataclass(frozen=True)
class Push:
    """Audio of the job: (n,) or (n, channels), any length."""

    job: Job
    pcm: np.ndarray
    arrived: float  # perf_counter when the audio arrived: the job's hops are due from then (lateness)
    seq: int  # the push's sequence number, acknowledged once all of its audio is stepped


@dataclass(frozen=True)
class End:
    """Flush the job: its tail is the last delivery (final), then the worker frees its lanes."""

    job: Job
    seq: int  # the last push's sequence number, acknowledged with the tail
    # instead of the tail: the output of every whole hop received, then the stream's state (a restart);
    # the tail after all where the state is too large or cannot be taken
    suspend: bool = False


@dataclass(frozen=True)
class Close:
    """Drop the job now, whatever it still holds."""

    job: Job


Command = Open | Push | End | Close


class Inbox(Protocol):
    """Where a job's commands go: the inference worker that runs it."""

    def submit(self, cmd: Command) -> None: ...


class Arrivals:
    """When a live job's hops arrived, to tell when each one is due."""

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
        """When hop `hop` (the job's index) could first have been stepped by a real-time server."""
        while self.pushes and self.pushes[0][0] <= hop:
            self.pushes.popleft()
        arrival = self.pushes[0][1] if self.pushes else 0.0
        return max(arrival, (self.first_arrival or 0.0) + hop * hop_s)


class Job:
    """One admitted stream or file. The event loop uses `push`, `end`, `close`, `next`, `process`
    and `finish` (not thread-safe: from the event loop only); the worker applies the commands they
    enqueue and keeps its state for the job in the worker-side fields (its thread only).

    `worker`, `ledger` and `release` are the scheduler's (`Scheduler.open`); `loop` is where the
    deliveries go (default: the running event loop)."""

    def __init__(self, job_id: int, source: Source, sample_rate: int, channels: int, metadata: bool = False, *,
                 worker: Inbox | None = None, ledger: LaneLedger | None = None,
                 release: Callable[[Job], None] | None = None, loop: asyncio.AbstractEventLoop | None = None):
        # parameters: set here, read by both threads
        self.id, self.source = job_id, Source(source)
        self.sample_rate, self.channels, self.metadata = sample_rate, channels, metadata
        self.live = self.source == Source.STREAM
        self.worker = worker
        self.ledger = ledger  # the worker's ledger, where this job's lanes are reserved
        self._release = release  # gives the lanes back (event loop)
        self.loop = loop if loop is not None else asyncio.get_running_loop()
        # event-loop side
        self.queue: asyncio.Queue[Delivery] = asyncio.Queue()
        self.sent = 0  # pushes enqueued: the sequence number of the last one
        self.in_flight: collections.deque = collections.deque()  # (seq, samples) of pushes not yet acknowledged
        self.buffered = 0  # samples of those pushes
        self.acknowledged = asyncio.Event()  # set by every delivery (a handler waits on it for room)
        self.ended = False
        self.closed = False
        # worker side
        self.cursor: StreamCursor | None = None  # set when the worker opens the job
        self.acked = 0  # sequence number of the last push applied: acknowledged once no hop of it is left
        self.flushing = False
        self.suspending = False  # stepped live to the last whole hop, then its state is the final delivery
        self.dirty = False  # has output or an acknowledgement to deliver
        self.ready_since = 0.0  # when its oldest ready hop became ready (perf_counter)
        self.arrivals = Arrivals()
        self.due = 0.0  # due time of the hop in the current round
        self.behind = False  # told the client it is late, not yet that it is on time again
        self.events: list[Event] = []  # for the client, delivered with the next output

    # ------------------------------------------------------------------ worker side
    @property
    def stepping_live(self) -> bool:
        """Live and not flushing its tail: its hops are stepped as they come."""
        return self.live and not self.flushing

    @property
    def steps(self) -> int:
        """Hops stepped or skipped so far (the index of the next hop)."""
        return self.cursor.hops_out

    # ------------------------------------------------------------------ event-loop side
    def push(self, pcm: np.ndarray) -> int:
        """Queue audio (n,) or (n, channels); returns its sequence number."""
        if self.closed or self.ended:
            raise RuntimeError("job is finished")
        self.sent += 1
        n = int(np.shape(pcm)[0])
        self.in_flight.append((self.sent, n))
        self.buffered += n
        self.worker.submit(Push(self, pcm, time.perf_counter(), self.sent))
        return self.sent

    def end(self, suspend: bool = False) -> None:
        """Flush the tail; the last delivery has `final=True` and the worker frees the lanes. With
        `suspend`, the last delivery carries the stream's state instead of the tail (`End`)."""
        if not (self.closed or self.ended):
            self.ended = True
            self.worker.submit(End(self, self.sent, suspend))

    def close(self) -> None:
        """Drop the job (any time, e.g. on disconnect); idempotent."""
        if not self.closed:
            self.closed = True
            self.worker.submit(Close(self))
            self._release(self)

    async def next(self) -> Delivery:
        """The next delivery; the pushes it acknowledges leave `in_flight` (all of them with the
        final one)."""
        d = await self.queue.get()
        while self.in_flight and (d.final or self.in_flight[0][0] <= d.acked):
            self.buffered -= self.in_flight.popleft()[1]
        self.acknowledged.set()
        return d

    async def process(self, pcm: np.ndarray) -> np.ndarray:
        """Push `pcm` and wait until all of it is processed; returns the output made meanwhile."""
        seq = self.push(pcm)
        return await self._collect(lambda d: d.acked >= seq)

    async def finish(self) -> np.ndarray:
        """`end` and wait for the tail."""
        self.end()
        return await self._collect(lambda d: d.final)

    async def _collect(self, last) -> np.ndarray:
        """The audio of the deliveries up to the first for which `last(delivery)` holds."""
        parts = []
        while True:
            d = await self.next()
            if d.error:
                raise d.error
            parts.append(d.audio)
            if last(d):
                return np.concatenate(parts)

    def deliver(self, d: Delivery) -> None:
        """Called on the event loop with each of the worker's deliveries."""
        if not self.closed:
            self.queue.put_nowait(d)
