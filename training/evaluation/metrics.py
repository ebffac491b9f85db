"""Intrusive quality metrics at 16 kHz: wideband PESQ (ITU-T P.862.2), STOI, ESTOI, SI-SDR, and the
level at which the reference speech comes back.

All take the clean reference first and the signal to score second, float (n,) arrays of equal
length at 16 kHz (`align` crops two signals to the shorter).
"""
from __future__ import annotations

import math

import numpy as np

from enhancer.config import SAMPLE_RATE

INTRUSIVE = ("pesq_wb", "stoi", "estoi", "si_sdr", "speech_level")  # the keys of `intrusive`, in report order
DNSMOS_KEYS = ("dnsmos_sig", "dnsmos_bak", "dnsmos_ovrl")  # training.evaluation.dnsmos, as eval reports it
# How every report (eval, bench-peers, ablation) names the metrics.
LABELS = {"pesq_wb": "PESQ-WB", "stoi": "STOI", "estoi": "ESTOI", "si_sdr": "SI-SDR (dB)", "speech_level": "Speech level (dB)",
          "dnsmos_sig": "DNSMOS SIG", "dnsmos_bak": "DNSMOS BAK", "dnsmos_ovrl": "DNSMOS OVRL"}
SI_SDR_CEILING_DB = 200.0  # identical signals score this instead of +inf; a silent estimate scores its negative
# P.862.2's MOS-LQO of the lowest raw PESQ (-0.5): 0.999 + 4 / (1 + exp(1.3669 * 0.5 + 3.8224)). What an
# output that is silent (or too quiet for the PESQ code, below about 1e-20 of the reference) scores.
PESQ_WB_FLOOR = 1.0427
SPEECH_LEVEL_FLOOR_DB = -100.0  # a signal holding none of the reference (or only its inverse) scores this


def align(ref: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = min(len(ref), len(x))
    return np.asarray(ref[:n], np.float64), np.asarray(x[:n], np.float64)


def si_sdr(ref: np.ndarray, est: np.ndarray) -> float:
    """Scale-invariant SDR in dB (Le Roux et al., 2019), both signals made zero-mean."""
    ref, est = align(ref, est)
    ref = ref - ref.mean()
    est = est - est.mean()
    energy = float(ref @ ref)
    if energy <= 0.0:
        return float("nan")
    target = (float(est @ ref) / energy) * ref
    noise = est - target
    t, n = float(target @ target), float(noise @ noise)
    if t <= 0.0:  # a silent estimate, or one orthogonal to the reference, holds none of it
        return -SI_SDR_CEILING_DB
    if n <= t * 10.0 ** (-SI_SDR_CEILING_DB / 10.0):
        return SI_SDR_CEILING_DB
    return 10.0 * math.log10(t / n)


def speech_level(ref: np.ndarray, est: np.ndarray) -> float:
    """The level of the reference speech found in `est`, in dB against the reference itself:
    20 log10(<est, ref> / <ref, ref>), the gain of `est`'s projection on `ref`. 0 dB: the speech comes
    back at its own level; -3 dB: 3 dB quieter (attenuated, or partly removed with the noise). Noise
    uncorrelated with the speech does not count. NaN for a silent reference."""
    ref, est = align(ref, est)
    energy = float(ref @ ref)
    if energy <= 0.0:
        return float("nan")
    gain = float(est @ ref) / energy
    floor = 10.0 ** (SPEECH_LEVEL_FLOOR_DB / 20.0)
    return 20.0 * math.log10(gain) if gain > floor else SPEECH_LEVEL_FLOOR_DB


def pesq_wb(ref: np.ndarray, deg: np.ndarray, sample_rate: int = SAMPLE_RATE) -> float:
    """Wideband PESQ (MOS-LQO, 1.04..4.64) via the `pesq` package; NaN if the reference holds no
    speech; `PESQ_WB_FLOOR` for a silent output (the PESQ code fails on one: an enhancer that removes
    everything must score the worst, not drop out of the means)."""
    from pesq import NoUtterancesError, pesq

    ref, deg = align(ref, deg)
    try:
        return float(pesq(sample_rate, ref, deg, "wb"))
    except NoUtterancesError:
        return float("nan")
    except ValueError:
        if np.max(np.abs(deg), initial=0.0) <= 1e-20 * np.max(np.abs(ref), initial=0.0):
            return PESQ_WB_FLOOR
        raise


def stoi(ref: np.ndarray, deg: np.ndarray, sample_rate: int = SAMPLE_RATE, extended: bool = False) -> float:
    from pystoi import stoi as _stoi

    ref, deg = align(ref, deg)
    return float(_stoi(ref, deg, sample_rate, extended=extended))


def intrusive(ref: np.ndarray, deg: np.ndarray, sample_rate: int = SAMPLE_RATE) -> dict[str, float]:
    """All intrusive metrics of one signal against its reference."""
    return {
        "pesq_wb": pesq_wb(ref, deg, sample_rate),
        "stoi": stoi(ref, deg, sample_rate),
        "estoi": stoi(ref, deg, sample_rate, extended=True),
        "si_sdr": si_sdr(ref, deg),
        "speech_level": speech_level(ref, deg),
    }
