"""Progress display: a tqdm bar on a terminal, a plain line every `interval` seconds otherwise
(so a log file from `nohup` stays readable)."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int | None, initial: int = 0, enabled: bool = True, interval: float = 30.0, stream=None):
        self.enabled, self.interval = enabled, interval
        self.stream = stream or sys.stderr
        self.total = total
        self.bar = None
        self.last = time.time()
        self.acc, self.n = 0.0, 0
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=self.stream)

    def update(self, step: int, loss: float, rate: float, lr: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(f"loss {loss:.4f}, {rate:.1f} audio-s/s, lr {lr:.1e}", refresh=False)
            return
        self.acc, self.n = self.acc + loss, self.n + 1
        now = time.time()
        if now - self.last >= self.interval:
            self.last = now
            of = f"/{self.total}" if self.total else ""
            self.write(f"step {step}{of}: loss {self.acc / self.n:.4f} (mean of {self.n} steps), {rate:.1f} audio-s/s, lr {lr:.1e}")
            self.acc, self.n = 0.0, 0

    def write(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg, file=self.stream)
        else:
            print(f"{time.strftime('%H:%M:%S')} {msg}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
