"""Progress display: a tqdm bar on a terminal, a plain line every `interval` seconds otherwise
(so a log file from `nohup` stays readable)."""
from __future__ import annotations

import math
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


class StepRates:
    """The train rows' figures: every `every` steps, the mean loss of those steps and their audio
    seconds per wall second (`rate`: the last row's, NaN before the first); and the wall time of
    every step counted (`total_s`)."""

    def __init__(self, audio_s_per_step: float, every: int):
        self.audio_s_per_step, self.every = audio_s_per_step, every
        self.loss, self.n, self.seconds = 0.0, 0, 0.0  # since the last row
        self.rate = float("nan")
        self.total_s = 0.0

    def add(self, loss: float, dt: float) -> float | None:
        """Count a step of `loss` that took `dt` s: the mean loss since the last row when a row is
        due (then `rate` is that row's), else None."""
        self.loss, self.n, self.seconds, self.total_s = self.loss + loss, self.n + 1, self.seconds + dt, self.total_s + dt
        if self.n < self.every:
            return None
        mean, self.rate = self.loss / self.n, self.audio_s_per_step * self.n / self.seconds
        self.loss, self.n, self.seconds = 0.0, 0, 0.0
        return mean

    def shown(self, dt: float) -> float:
        """The rate to display after a step of `dt` s: the last row's, or that step's before the first row."""
        return self.rate if math.isfinite(self.rate) else self.audio_s_per_step / dt
