"""The one scorer of the peer benchmark: PESQ-WB, STOI, ESTOI and SI-SDR at 16 kHz.

`score(enhanced, clean, sr)` is the only entry point; it checks the alignment, resamples to
16 kHz and calls `training.evaluation.metrics.intrusive`, the scorer of `enhancer-train eval`, so the
benchmark and the evaluation of the model always agree.
"""
from __future__ import annotations

from enhancer.config import SAMPLE_RATE as SCORE_RATE

from ..evaluation.metrics import INTRUSIVE as METRICS
from ..evaluation.metrics import intrusive
from .align import as_mono, resample


def score(enhanced, clean, sr: int) -> dict[str, float]:
    """All metrics of `enhanced` against `clean` (same length, aligned), both at `sr`."""
    e, c = as_mono(enhanced), as_mono(clean)
    if len(e) != len(c):
        raise ValueError(f"enhanced has {len(e)} samples, clean {len(c)}: they must be aligned")
    if sr != SCORE_RATE:
        e, c = resample(e, sr, SCORE_RATE), resample(c, sr, SCORE_RATE)
    scores = intrusive(c, e, SCORE_RATE)
    return {m: scores[m] for m in METRICS}
