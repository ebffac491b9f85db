"""Scoring a dev set during training: the model enhances paired noisy/clean files offline and the
trainer keeps the best checkpoint by the rule of `decide`: PESQ-WB + DNSMOS OVRL, neither of the two
traded away (PESQ-WB alone without the DNSMOS models).

A validation loss says how well the model fits the training objective on held-out mixtures of the
training *kinds*; PESQ on the unseen-source dev set (`enhancer-train devset --unseen`) says what users
hear on noises and voices the model has never met, which is what checkpoints are chosen for.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from enhancer.config import SAMPLE_RATE

from ..data.manifests import DataError
from .decide import better


@dataclass(frozen=True)
class DevScore:
    pesq_wb: float
    dnsmos_ovrl: float  # NaN without the DNSMOS models
    files: int

    def better_than(self, other: DevScore | None) -> bool:
        """The checkpoint rule of `decide.better`; any finite score beats none."""
        if other is None:
            return math.isfinite(self.pesq_wb)
        return better(self.pesq_wb, self.dnsmos_ovrl, other.pesq_wb, other.dnsmos_ovrl)

    def to_dict(self) -> dict:
        return {"pesq_wb": self.pesq_wb, "dnsmos_ovrl": self.dnsmos_ovrl, "files": self.files}

    @classmethod
    def from_dict(cls, d: dict | None) -> DevScore | None:
        return None if not d else cls(float(d["pesq_wb"]), float(d["dnsmos_ovrl"]), int(d["files"]))


def load_dev_pairs(folder, limit: int | None = None) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, noisy, clean) of `folder/noisy` and `folder/clean` at 16 kHz; with `limit`, an evenly
    spaced selection in name order (the dev sets' names cycle through SNRs and noise kinds, so an even
    spacing keeps every SNR and kind)."""
    from ..data.audio_cache import read16k
    from ..data.layouts import paired_folders

    folder = Path(folder)
    pairs = paired_folders(folder / "noisy", folder / "clean")
    pairs = sorted(pairs, key=lambda p: p.name)
    if limit is not None and 0 < limit < len(pairs):
        idx = np.unique(np.linspace(0, len(pairs) - 1, limit).round().astype(int))
        pairs = [pairs[i] for i in idx]
    out = []
    for p in pairs:
        noisy, clean = read16k(p.noisy), read16k(p.clean)
        n = min(len(noisy), len(clean))
        if n < SAMPLE_RATE:
            raise DataError(f"dev pair {p.name}: shorter than 1 s")
        out.append((p.name, noisy[:n], clean[:n]))
    if not out:
        raise DataError(f"no dev pairs in {folder}")
    return out


class DevScorer:
    """Scores a torch model on a share of the dev pairs (`rank` of `world`); the caller sums the
    shares across processes."""

    def __init__(self, pairs, rank: int = 0, world: int = 1, dnsmos_dir=None):
        self.pairs = pairs[rank::world]
        self.dnsmos = None
        if dnsmos_dir is not None and Path(dnsmos_dir).is_dir():
            from .dnsmos import DNSMOS

            self.dnsmos = DNSMOS(dnsmos_dir)

    def partial(self, model) -> list[float]:
        """[sum of PESQ, PESQ count, sum of OVRL, OVRL count] over this share."""
        import torch

        from .metrics import pesq_wb

        was_training = model.training
        model.eval()
        sums = [0.0, 0.0, 0.0, 0.0]
        try:
            with torch.no_grad():
                for _name, noisy, clean in self.pairs:
                    enhanced = model.enhance(torch.from_numpy(noisy)[None])[0].float().numpy()
                    p = pesq_wb(clean, enhanced)
                    if math.isfinite(p):
                        sums[0] += p
                        sums[1] += 1
                    if self.dnsmos is not None:
                        sums[2] += self.dnsmos.score(enhanced)["ovrl"]
                        sums[3] += 1
        finally:
            model.train(was_training)
        return sums


def combine(sums: list[float]) -> DevScore:
    pesq = sums[0] / sums[1] if sums[1] else float("nan")
    ovrl = sums[2] / sums[3] if sums[3] else float("nan")
    return DevScore(pesq, ovrl, int(sums[1]))
