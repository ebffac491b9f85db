"""The one scorer of the peer benchmark: PESQ-WB, STOI, ESTOI, SI-SDR and the speech level at 16 kHz, and DNSMOS
P.835 SIG / BAK / OVRL when a DNSMOS model is given.

`score(enhanced, clean, sr, dnsmos)` is the only entry point; it checks the alignment, resamples to
16 kHz and calls `training.evaluation.metrics.intrusive` and `training.evaluation.dnsmos.DNSMOS`, the
scorers of `enhancer-train eval`, so the benchmark and the evaluation of the model always agree.
"""
from __future__ import annotations

from enhancer.config import SAMPLE_RATE as SCORE_RATE

from ..evaluation.metrics import DNSMOS_KEYS, intrusive
from ..evaluation.metrics import INTRUSIVE as METRICS
from .align import as_mono, resample

ALL_METRICS = METRICS + DNSMOS_KEYS  # every column a report may carry, in report order


def score(enhanced, clean, sr: int, dnsmos=None) -> dict[str, float]:
    """All metrics of `enhanced` against `clean` (same length, aligned), both at `sr`; with a
    `training.evaluation.dnsmos.DNSMOS`, also its SIG / BAK / OVRL of `enhanced` (no reference)."""
    e, c = as_mono(enhanced), as_mono(clean)
    if len(e) != len(c):
        raise ValueError(f"enhanced has {len(e)} samples, clean {len(c)}: they must be aligned")
    if sr != SCORE_RATE:
        e, c = resample(e, sr, SCORE_RATE), resample(c, sr, SCORE_RATE)
    scores = intrusive(c, e, SCORE_RATE)
    out = {m: scores[m] for m in METRICS}
    if dnsmos is not None:
        d = dnsmos.score(e)
        out.update({f"dnsmos_{k}": d[k] for k in ("sig", "bak", "ovrl")})
    return out
