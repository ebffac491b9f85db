"""Admission: which jobs the service takes on, and on which worker (README, "Capacity, admission
and lateness").

Live streams are admitted up to the capacity (measured at start-up and re-estimated while serving,
`server.scheduling.capacity`), in total
and on the worker that takes them; files (REST jobs) only use the lanes and the time the live
streams leave free. Each worker's lanes have one `LaneLedger`, the one record of its capacity and
of the lanes its admitted jobs hold: admission writes it on the event loop, the worker reads it
to size the files it runs beside its live streams.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from enhancer.cursor import check_channels
from enhancer.errors import AudioError
from enhancer.runtime import min_gain_for
from enhancer.signal import check_rate
from server.errors import ErrorKind, ServiceError, from_core
from server.messages import Source
from server.metrics import Metrics
from server.scheduling.capacity import Capacity
from server.settings import Settings

STREAM_RETRY_S = 5  # retry hint for a stream refused over capacity (streams hold their lanes for minutes)
REST_RETRY_S = 1
LOG_MOVE = 0.25  # a re-estimated capacity is logged when it moved by this share since the last one logged

log = logging.getLogger("tim_enhancer.server")


@dataclass
class LaneLedger:
    """One worker's lanes: written by admission (event loop), read by the worker's thread."""

    size: int  # lanes of the worker's pool
    capacity: int  # live lanes it holds within the step budget
    free: int  # lanes not reserved by an admitted job
    live: int = 0  # lanes reserved by admitted live streams

    @property
    def live_room(self) -> int:
        """Live lanes this worker can still admit."""
        return self.capacity - self.live


def check_parameters(settings: Settings, sample_rate, channels, atten_lim_db) -> int:
    """The sample rate as an int, or ServiceError (invalid_parameter) for any parameter of a job."""
    try:
        rate = check_rate(sample_rate)
        check_channels(channels, settings.max_channels)
        min_gain_for(atten_lim_db)
    except AudioError as e:
        raise from_core(e, ErrorKind.INVALID_PARAMETER) from None
    return rate


class Admission:
    """Admission of streams and files onto the workers' ledgers (event loop only)."""

    def __init__(self, settings: Settings, metrics: Metrics):
        self.settings, self.metrics = settings, metrics
        self.ledgers: list[LaneLedger] = []
        self.capacity: Capacity | None = None  # measured, or fixed by the settings
        self.logged: Capacity | None = None  # the capacity last written to the log
        self.streams = 0  # live streams admitted now
        self.rest_jobs = 0  # files admitted now
        self.opened = 0  # jobs ever admitted

    def set_capacity(self, capacity: Capacity, ledgers: list[LaneLedger]) -> None:
        """The capacity the service admits, spread over the workers' ledgers."""
        self.ledgers = ledgers
        self._apply(capacity)
        self.logged = capacity
        log.info("capacity: %d live stream(s) (%s; per worker %s)", capacity.streams,
                 "measured" if capacity.calibrated else "fixed", list(capacity.per_worker))

    def update_capacity(self, capacity: Capacity, reasons: list[str]) -> None:
        """A capacity re-estimated while serving (`CapacityTracker`). Admitted streams are never
        dropped: a lower capacity only stops new admissions until the live lanes fit it. Logged when
        it has moved by `LOG_MOVE` or more since it was last logged (every change is in /metrics)."""
        self._apply(capacity)
        old = self.logged
        if old is not None and abs(capacity.streams - old.streams) < LOG_MOVE * max(old.streams, 1):
            return
        self.logged = capacity
        log.info("capacity: %d -> %d live stream(s) (re-estimated from the step timings; per worker %s -> %s; %d "
                 "active): %s", old.streams if old else 0, capacity.streams, list(old.per_worker) if old else [],
                 list(capacity.per_worker), self.streams, "; ".join(reasons))

    def _apply(self, capacity: Capacity) -> None:
        for ledger, live in zip(self.ledgers, capacity.per_worker):
            ledger.capacity = live
        self.capacity = capacity
        m = self.metrics
        m.capacity.set(capacity.streams)
        m.step_budget.set(capacity.budget_ms / 1000)
        m.calibrated.set(int(capacity.calibrated))
        for i, lanes in enumerate(capacity.per_worker):
            m.capacity_worker.labels(worker=str(i)).set(lanes)

    @property
    def live_lanes(self) -> int:
        """Lanes held by admitted live streams, all workers together."""
        return sum(ledger.live for ledger in self.ledgers)

    @property
    def live_full(self) -> bool:
        """No live stream can be admitted now (checked at the websocket handshake)."""
        cap = self.capacity
        return cap is not None and (self.streams >= self.settings.max_streams or self.live_lanes >= cap.streams
                                    or not any(ledger.live_room > 0 for ledger in self.ledgers))

    def admit(self, source: Source, channels: int) -> int:
        """Reserve `channels` lanes for a job on the least loaded worker; its index, or
        ServiceError (over_capacity)."""
        s = self.settings
        if source == Source.REST and self.rest_jobs >= s.max_rest_jobs:
            self.metrics.refused.labels(source=source).inc()
            log.info("refused a file: %d enhancements in progress, the limit", self.rest_jobs)
            raise ServiceError(ErrorKind.OVER_CAPACITY, f"server is at its limit of {s.max_rest_jobs} concurrent "
                               f"enhancements; retry in {REST_RETRY_S} s", retry_after_s=REST_RETRY_S)
        i = max(range(len(self.ledgers)), key=lambda i: (self.ledgers[i].live_room, self.ledgers[i].free))
        ledger = self.ledgers[i]
        if source == Source.STREAM:
            # admitted live lanes stay within the measured capacity, in total and on the chosen worker
            if (self.streams >= s.max_streams or self.live_lanes + channels > self.capacity.streams
                    or ledger.live_room < channels):
                raise self.over_capacity(source, channels)
        elif ledger.live_room <= 0:
            # files use what the live streams leave: refused when live streams hold every worker's capacity
            raise self.over_capacity(source)
        if ledger.free < channels:
            raise ServiceError(ErrorKind.OVER_CAPACITY, "no free inference lanes; retry later",
                               retry_after_s=REST_RETRY_S)
        ledger.free -= channels
        self.opened += 1
        if source == Source.STREAM:
            ledger.live += channels
            self.streams += 1
            self.metrics.active_streams.set(self.streams)
            self.metrics.live_lanes.set(self.live_lanes)
        else:
            self.rest_jobs += 1
            self.metrics.active_jobs.set(self.rest_jobs)
        return i

    def release(self, ledger: LaneLedger, source: Source, channels: int) -> None:
        """Give back what `admit` reserved."""
        ledger.free += channels
        if source == Source.STREAM:
            ledger.live -= channels
            self.streams -= 1
            self.metrics.active_streams.set(self.streams)
            self.metrics.live_lanes.set(self.live_lanes)
        else:
            self.rest_jobs -= 1
            self.metrics.active_jobs.set(self.rest_jobs)

    def over_capacity(self, source: Source, channels: int = 1) -> ServiceError:
        """The refusal of a job for capacity (1013 / 503), counted and logged."""
        cap = self.capacity.streams if self.capacity else self.settings.max_streams
        details = {"capacity": cap, "active_streams": self.streams}
        self.metrics.refused.labels(source=source).inc()
        if source == Source.STREAM:
            free = max(max((ledger.live_room for ledger in self.ledgers), default=0), 0)
            room = ("all are in use" if free == 0 or self.streams >= self.settings.max_streams else
                    f"a worker has room for {free} channel(s), this stream has {channels}")
            log.info("refused a live stream (1013): capacity %d, %d active, %s", cap, self.streams, room)
            return ServiceError(
                ErrorKind.OVER_CAPACITY, f"over capacity: this server holds {cap} live stream(s) in real time (mono; "
                f"each channel counts) and {room}; retry in {STREAM_RETRY_S} s or use another instance",
                details, STREAM_RETRY_S)
        log.info("refused a file (503): the live streams use all of the capacity (%d)", cap)
        return ServiceError(ErrorKind.OVER_CAPACITY, f"over capacity: the live streams use all of this server's "
                            f"inference capacity ({cap} streams); retry in {REST_RETRY_S} s", details, REST_RETRY_S)

    @property
    def free(self) -> int:
        """Live lanes that can still be admitted (all workers together)."""
        cap = self.capacity
        return max((cap.streams if cap else 0) - self.live_lanes, 0)

    def public(self) -> dict:
        """Capacity and live count for /readyz."""
        cap = self.capacity
        out = cap.public() if cap is not None else {}
        return out | {"active_streams": self.streams, "live_lanes": self.live_lanes, "free": self.free}
