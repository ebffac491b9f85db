"""The checkpoint folder of a run: `OUT/checkpoints/step-00001234.pt` (the last N) and `best.pt`.

Each file is a regular tim-enhancer checkpoint (`enhancer.save_checkpoint`, written atomically), so
`enhancer export OUT/checkpoints/best.pt` works on it; the training state (optimizer, schedule,
step, random generator states, data position) rides in its "extra" field.
"""
from __future__ import annotations

import re
from pathlib import Path

from enhancer import save_checkpoint

BEST = "best.pt"
_STEP = re.compile(r"step-(\d+)\.pt$")


class CheckpointDir:
    def __init__(self, out, keep_last: int = 3):
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        self.dir = Path(out) / "checkpoints"
        self.keep_last = keep_last

    def steps(self) -> list[tuple[int, Path]]:
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _STEP.search(p.name))]
        return sorted(found)

    def latest(self) -> Path | None:
        s = self.steps()
        return s[-1][1] if s else None

    @property
    def best(self) -> Path:
        return self.dir / BEST

    def save(self, model, config, step: int, **extra) -> Path:
        path = save_checkpoint(model, config, self.dir / f"step-{step:08d}.pt", **extra)
        for _, old in self.steps()[: -self.keep_last]:
            old.unlink(missing_ok=True)
        return path

    def save_best(self, model, config, **extra) -> Path:
        return save_checkpoint(model, config, self.best, **extra)
