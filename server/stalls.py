"""What can hold up a live stream outside inference: event-loop lag and garbage-collector pauses.

A websocket stream has about 64 ms of slack per message (see `tools.loadtest`); the event loop
receives, decodes and sends every message, so anything that blocks it for tens of milliseconds
makes every stream late at once. Two sources are measured and exported as metrics:

* `LoopLagMonitor`: a task that sleeps `interval` and records how much later than asked it woke up
  (`tim_event_loop_lag_seconds`).
* `GcTimer`: the duration of every cyclic garbage collection, by generation
  (`tim_gc_pause_seconds`), from `gc.callbacks`.

`freeze_startup_objects()` moves everything alive after start-up (FastAPI, pydantic, numpy,
onnxruntime bindings: several hundred thousand objects) into the collector's permanent generation,
so a full collection scans only what streams allocate, not the whole process.

Whether the whole machine stalled (not the service) is the benchmark tools' question:
`tools.machine_stalls`.
"""
from __future__ import annotations

import asyncio
import gc
import time


def freeze_startup_objects() -> int:
    """Collect once, then freeze what is left; returns the number of frozen objects."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcTimer:
    """Observes the duration of each collection of generation 1 and 2 into `histogram` (labelled by
    generation) while installed. Young-generation collections run hundreds of times a second and
    take microseconds: they are not timed, so that the callback itself costs next to nothing."""

    def __init__(self, histogram):
        self._by_gen = {g: histogram.labels(generation=str(g)) for g in (1, 2)}
        self._t0 = 0.0
        self.installed = False

    def __call__(self, phase: str, info: dict) -> None:
        child = self._by_gen.get(info.get("generation"))
        if child is None:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            child.observe(time.perf_counter() - self._t0)

    def install(self) -> None:
        if not self.installed:
            gc.callbacks.append(self)
            self.installed = True

    def uninstall(self) -> None:
        if self.installed:
            gc.callbacks.remove(self)
            self.installed = False


class LoopLagMonitor:
    """Records into `histogram` how late the event loop runs a timer set `interval` seconds ahead."""

    def __init__(self, histogram, interval: float = 0.05):
        self.histogram, self.interval = histogram, interval
        self.max_lag = 0.0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            lag = max(0.0, loop.time() - due)
            self.max_lag = max(self.max_lag, lag)
            self.histogram.observe(lag)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
