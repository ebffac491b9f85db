"""The event loop's handle on one admitted stream or file: `Job`.

Websocket and REST handlers hold a `Job` and only enqueue commands (`server.scheduling.commands`) to the
worker that runs it; its deliveries come back on the event loop, in order.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np

from server.messages import Source
from server.scheduling.admission import LaneLedger
from server.scheduling.commands import Close, Delivery, End, Push
from server.scheduling.worker import Worker


class Job:
    """The event-loop side of one stream: enqueue audio, await deliveries. Not thread-safe: use it
    from the event loop only."""

    def __init__(self, job_id: int, worker: Worker, ledger: LaneLedger, sample_rate: int, channels: int,
                 metadata: bool, source: Source, release: Callable[[Job], None]):
        self.id = job_id
        self.worker = worker
        self.ledger = ledger  # the worker's ledger, where this job's lanes are reserved
        self.sample_rate, self.channels, self.metadata, self.source = sample_rate, channels, metadata, source
        self._release = release  # gives the lanes back (event loop)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Delivery] = asyncio.Queue()
        self.sent = 0  # pushes enqueued
        self.acked = 0  # pushes fully processed
        self.ended = False
        self.closed = False

    def push(self, pcm: np.ndarray) -> int:
        """Queue audio (n,) or (n, channels); returns its sequence number."""
        if self.closed or self.ended:
            raise RuntimeError("job is finished")
        self.sent += 1
        self.worker.submit(Push(self, pcm, time.perf_counter(), self.sent))
        return self.sent

    def end(self) -> None:
        """Flush the tail; the last delivery has `final=True` and the worker frees the lanes."""
        if not (self.closed or self.ended):
            self.ended = True
            self.worker.submit(End(self, self.sent))

    def close(self) -> None:
        """Drop the stream (any time, e.g. on disconnect); idempotent."""
        if not self.closed:
            self.closed = True
            self.worker.submit(Close(self))
            self._release(self)

    async def next(self) -> Delivery:
        d = await self.queue.get()
        self.acked = max(self.acked, d.acked)
        return d

    async def process(self, pcm: np.ndarray) -> np.ndarray:
        """Push `pcm` and wait until all of it is processed; returns the output made meanwhile."""
        seq = self.push(pcm)
        parts = []
        while self.acked < seq:
            d = await self.next()
            if d.error:
                raise d.error
            parts.append(d.audio)
        return np.concatenate(parts) if parts else np.zeros((0, self.channels), np.float32)

    async def finish(self) -> np.ndarray:
        """`end` and wait for the tail."""
        self.end()
        parts = []
        while True:
            d = await self.next()
            if d.error:
                raise d.error
            parts.append(d.audio)
            if d.final:
                return np.concatenate(parts)

    def deliver(self, d: Delivery) -> None:
        """Called on the event loop with each of the worker's deliveries."""
        if not self.closed:
            self.queue.put_nowait(d)
