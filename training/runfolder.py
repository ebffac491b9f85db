"""The files of a run folder besides its checkpoints: `config.json` (the model config), `train.json`
(the options, mixing settings, batch, seed, processes and data of the run) and `metrics.csv` (one
row per `--log-every` steps and one per validation). Written by rank 0 only."""
from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path

METRICS_COLUMNS = ("step", "examples", "hours", "split", "loss", "lr", "audio_s_per_s", "grad_norm")


class RunFolder:
    def __init__(self, out: Path, enabled: bool = True):
        self.out = Path(out)
        self.enabled = enabled  # rank 0 writes, the other ranks do nothing

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.csv"

    def start(self, step: int, cfg, opts, info: dict) -> None:
        """config.json and train.json (`opts` without its config and mix, then `info`), and
        metrics.csv with its rows past `step` dropped (written after the last checkpoint of a
        crashed run)."""
        if not self.enabled:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        options = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items() if k not in ("config", "mix")}
        (self.out / "train.json").write_text(json.dumps({"options": options, **info}, indent=2, default=str) + "\n")
        self._trim_metrics(step)

    def _trim_metrics(self, step: int) -> None:
        p = self.metrics_path
        if not p.exists():
            with open(p, "w", newline="") as f:
                csv.writer(f).writerow(METRICS_COLUMNS)
            return
        with open(p, newline="") as f:
            rows = list(csv.DictReader(f))
        keep = [r for r in rows if int(r["step"]) <= step]
        if len(keep) != len(rows):
            with open(p, "w", newline="") as f:
                w = csv.DictWriter(f, METRICS_COLUMNS)
                w.writeheader()
                w.writerows(keep)

    def row(self, step: int, examples: int, hours: float, split: str, loss: float, lr: float,
            audio_rate: float = float("nan"), grad_norm: float = float("nan")) -> None:
        if not self.enabled:
            return
        with open(self.metrics_path, "a", newline="") as f:
            csv.writer(f).writerow([step, examples, f"{hours:.7f}", split, f"{loss:.6f}", f"{lr:.3e}",
                                    f"{audio_rate:.2f}", f"{grad_norm:.4f}"])
