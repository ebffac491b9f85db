"""What the event loop and an inference worker hand each other about a stream (`Job`): commands
from the loop to the worker (`Open`, `Push`, `End`, `Close`), and `Delivery`s back.

Commands are queued in order per worker and applied on its thread (`server.worker`); a Job's
deliveries come back through its event loop (`server.scheduler.Job`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import ServiceError


@dataclass
class Delivery:
    """Output of a stream handed to its handler: audio (n, channels) float32 at the stream's rate."""

    audio: np.ndarray
    frames: list = field(default_factory=list)  # (frame index, competition (c, n_tim, n_s) | None, activity (c,))
    acked: int = 0  # sequence number of the last push whose audio is fully processed
    final: bool = False  # the stream's tail after `end`; nothing follows
    error: ServiceError | None = None
    events: list = field(default_factory=list)  # JSON messages for the client ("late", "on_time", "gap")


@dataclass(frozen=True)
class Open:
    """Start the stream of an admitted job (its lanes are reserved)."""

    job: "Job"  # noqa: F821 - server.scheduler.Job (not imported: the scheduler imports this module)
    atten_lim_db: float | None


@dataclass(frozen=True)
class Push:
    """Audio of the stream: (n,) or (n, channels), any length."""

    job: "Job"  # noqa: F821
    pcm: np.ndarray
    arrived: float  # perf_counter when the audio arrived: the stream's hops are due from then (lateness)
    seq: int  # the push's sequence number, acknowledged once all of its audio is stepped


@dataclass(frozen=True)
class End:
    """Flush the stream: its tail is the last delivery (final), then the worker frees its lanes."""

    job: "Job"  # noqa: F821
    seq: int  # the last push's sequence number, acknowledged with the tail


@dataclass(frozen=True)
class Close:
    """Drop the stream now, whatever it still holds."""

    job: "Job"  # noqa: F821


Command = Open | Push | End | Close
