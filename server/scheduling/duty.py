"""What files (REST jobs) may use of a worker: `FileShare`.

Beside live jobs on the same worker, files ride in the lanes that the live jobs leave within
the worker's capacity (its `LaneLedger`). In a step of their own, while live jobs are served
anywhere in the service (the cores are shared), files step only within a duty cycle: a credit
refills at (1 - capacity_margin) s per s, up to one hop's worth, and every inference call spends
its duration.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from server.scheduling.admission import LaneLedger
from server.scheduling.jobs import Job


class FileShare:
    """One worker's share for files (its thread only)."""

    def __init__(self, ledger: LaneLedger, hop_s: float, margin: float, service_live: Callable[[], int]):
        self.ledger = ledger
        self.hop_s = hop_s
        self.duty = 1.0 - margin
        self.service_live = service_live  # live lanes admitted in the whole service
        self.credit, self.credit_t = 0.0, time.perf_counter()

    def spend(self, seconds: float, now: float) -> None:
        """An inference call of this worker took `seconds`, ending at `now`."""
        self._refill(now)
        self.credit -= seconds

    def _refill(self, now: float) -> None:
        self.credit = min(self.credit + (now - self.credit_t) * self.duty, self.hop_s * self.duty)
        self.credit_t = now

    def allowed(self, files: list[Job], with_live: bool, now: float) -> tuple[list[Job], float | None]:
        """The files that may step now (beside this worker's live jobs when `with_live`), and
        otherwise how long to wait before they may (None: until a command arrives)."""
        if not files:
            return [], None
        if not with_live and self.service_live():
            self._refill(now)
            if self.credit <= 0:
                return [], max(-self.credit / max(self.duty, 1e-3), 0.0005)
        ledger = self.ledger
        if not ledger.live:
            return files, None
        room = max(ledger.capacity - ledger.live, 0)
        chosen = []
        for job in files:
            if job.channels <= room:
                chosen.append(job)
                room -= job.channels
        return chosen, None
