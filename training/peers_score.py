"""The one scorer of the peer benchmark: PESQ-WB, STOI, ESTOI and SI-SDR at 16 kHz.

`score(enhanced, clean, sr)` is the only entry point, so the benchmark can switch to the
project-wide evaluation module by changing this file alone.
"""
from __future__ import annotations

import math

import numpy as np

from .peers_align import as_mono, resample

SCORE_RATE = 16000
METRICS = ("pesq_wb", "stoi", "estoi", "si_sdr")
LABELS = {"pesq_wb": "PESQ-WB", "stoi": "STOI", "estoi": "ESTOI", "si_sdr": "SI-SDR (dB)"}


def si_sdr(estimate: np.ndarray, reference: np.ndarray, eps: float = 1e-8) -> float:
    """Scale-invariant SDR in dB (both signals made zero-mean)."""
    s = np.asarray(reference, np.float64) - np.mean(reference)
    e = np.asarray(estimate, np.float64) - np.mean(estimate)
    target = (np.dot(e, s) / (np.dot(s, s) + eps)) * s
    noise = e - target
    return float(10.0 * np.log10((np.dot(target, target) + eps) / (np.dot(noise, noise) + eps)))


def pesq_wb(estimate: np.ndarray, reference: np.ndarray) -> float:
    """Wideband PESQ (ITU-T P.862.2) at 16 kHz; NaN when PESQ finds no utterance."""
    from pesq import NoUtterancesError, pesq

    try:
        return float(pesq(SCORE_RATE, reference, estimate, "wb"))
    except NoUtterancesError:
        return math.nan


def stoi(estimate: np.ndarray, reference: np.ndarray, extended: bool = False) -> float:
    from pystoi import stoi as _stoi

    return float(_stoi(reference, estimate, SCORE_RATE, extended=extended))


def score(enhanced, clean, sr: int) -> dict[str, float]:
    """All metrics of `enhanced` against `clean` (same length, aligned), both at `sr`."""
    e, c = as_mono(enhanced), as_mono(clean)
    if len(e) != len(c):
        raise ValueError(f"enhanced has {len(e)} samples, clean {len(c)}: they must be aligned")
    if sr != SCORE_RATE:
        e, c = resample(e, sr, SCORE_RATE), resample(c, sr, SCORE_RATE)
    return {
        "pesq_wb": pesq_wb(e, c),
        "stoi": stoi(e, c),
        "estoi": stoi(e, c, extended=True),
        "si_sdr": si_sdr(e, c),
    }
