"""Machine stalls: whether a late message was the machine's fault, not the service's.

A separate, almost idle process (`MachineStallObserver`) records every wake-up it gets late; when
it stalls together with the server and the load generator, the whole machine (a virtual CPU
descheduled by the host, for instance) was stalled. Used by `tools.loadtest` and
`tools.soak` to attribute late messages.
"""
from __future__ import annotations

import subprocess
import sys

STALL_S = 0.032  # a stall: a wake-up more than two 16 ms hops late

_OBSERVER = r"""
import sys, time
interval, record = float(sys.argv[1]), float(sys.argv[2])
out = sys.stdout
while True:
    due = time.perf_counter() + interval
    time.sleep(interval)
    now = time.perf_counter()
    if now - due > record:
        out.write(f"{due:.6f} {now - due:.6f}\n")
        out.flush()
"""


class MachineStallObserver:
    """A separate, almost idle process that wakes every `interval` and reports each wake-up more
    than `record_s` late. It competes for nothing, so when it stalls together with the server and
    the load generator, the whole machine (virtual CPU descheduled by the host, for instance) was
    stalled, not the service. Times are CLOCK_MONOTONIC (`time.perf_counter`), shared by all
    processes of the machine."""

    def __init__(self, interval: float = 0.005, record_s: float = 0.02):
        self.interval, self.record_s = interval, record_s
        self.proc = None
        self.events: list[tuple[float, float]] = []  # (perf_counter when due, lag s)

    def start(self) -> MachineStallObserver:
        self.proc = subprocess.Popen([sys.executable, "-c", _OBSERVER, str(self.interval), str(self.record_s)],
                                     stdout=subprocess.PIPE, text=True)
        return self

    def stop(self) -> list[tuple[float, float]]:
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate(timeout=10)
            self.events = [(float(a), float(b)) for a, b in (ln.split() for ln in out.splitlines() if ln.strip())]
            self.proc = None
        return self.events

    def explains(self, arrival: float, over_s: float = STALL_S, recovery_s: float = 1.5) -> bool:
        """Whether a message arriving at `arrival` (perf_counter) came within `recovery_s` after the
        end of a machine stall longer than `over_s` (the backlog of a stall takes a moment to clear)."""
        return stall_explains(self.events, arrival, over_s, recovery_s)


def stall_explains(events, arrival: float, over_s: float = STALL_S, recovery_s: float = 1.5) -> bool:
    """Whether `arrival` falls in one of the stalls `events` ((perf_counter when due, lag s) pairs)
    longer than `over_s`, or within `recovery_s` after its end."""
    return any(lag > over_s and t <= arrival <= t + lag + recovery_s for t, lag in events)
