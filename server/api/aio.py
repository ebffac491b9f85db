"""asyncio helpers shared by the handlers."""
from __future__ import annotations

import asyncio

if hasattr(asyncio, "timeout"):  # Python >= 3.11
    timeout = asyncio.timeout
else:  # pragma: no cover - Python 3.10
    class timeout:
        """asyncio.timeout for 3.10: raises TimeoutError after `delay`; `reschedule(when)` moves it."""

        def __init__(self, delay: float):
            self.loop = asyncio.get_running_loop()
            self.when = self.loop.time() + delay
            self.fired = False

        async def __aenter__(self):
            self.task = asyncio.current_task()
            self.handle = self.loop.call_at(self.when, self._fire)
            return self

        def _fire(self):
            self.fired = True
            self.task.cancel()

        def reschedule(self, when: float) -> None:
            self.handle.cancel()
            self.handle = self.loop.call_at(when, self._fire)

        async def __aexit__(self, kind, exc, tb):
            self.handle.cancel()
            if kind is asyncio.CancelledError and self.fired:
                raise asyncio.TimeoutError() from None
            return False
