"""What the event loop and an inference worker hand each other about a stream (`Job`): commands
from the loop to the worker (`Open`, `Push`, `End`, `Close`), and `Delivery`s back.

Commands are queued in order per worker and applied on its thread (`server.scheduling.worker`); a Job's
deliveries come back through its event loop (`server.scheduling.jobs.Job`). `JobHandle` is what a worker
sees of a job.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from enhancer.cursor import StepFrame
from server.errors import ServiceError
from server.messages import Event, Source


@dataclass
class Delivery:
    """Output of a stream handed to its handler: audio (n, channels) float32 at the stream's rate."""

    audio: np.ndarray
    frames: list[StepFrame] = field(default_factory=list)  # per-step metadata (with "metadata": true)
    acked: int = 0  # sequence number of the last push whose audio is fully processed
    final: bool = False  # the stream's tail after `end`; nothing follows
    error: ServiceError | None = None
    events: list[Event] = field(default_factory=list)  # for the client: Late, OnTime, Gap


class JobHandle(Protocol):
    """What an inference worker reads of a job (`server.scheduling.jobs.Job`), and how it hands output back."""

    id: int
    source: Source
    sample_rate: int
    channels: int
    metadata: bool
    sent: int  # pushes enqueued so far
    loop: asyncio.AbstractEventLoop  # the deliveries go through it

    def deliver(self, d: Delivery) -> None: ...


@dataclass(frozen=True)
class Open:
    """Start the stream of an admitted job (its lanes are reserved)."""

    job: JobHandle
    atten_lim_db: float | None
    band: str = "full"  # "full": the band above 8 kHz kept (above 16 kHz); "speech": up to 8 kHz


@dataclass(frozen=True)
class Push:
    """Audio of the stream: (n,) or (n, channels), any length."""

    job: JobHandle
    pcm: np.ndarray
    arrived: float  # perf_counter when the audio arrived: the stream's hops are due from then (lateness)
    seq: int  # the push's sequence number, acknowledged once all of its audio is stepped


@dataclass(frozen=True)
class End:
    """Flush the stream: its tail is the last delivery (final), then the worker frees its lanes."""

    job: JobHandle
    seq: int  # the last push's sequence number, acknowledged with the tail


@dataclass(frozen=True)
class Close:
    """Drop the stream now, whatever it still holds."""

    job: JobHandle


Command = Open | Push | End | Close
