"""Comparisons that scale with the signal: audio relative to its peak, log-spectra through the
error they inherit from the spectra, metrics in their own units (dB, PESQ points).

An absolute tolerance on raw audio or on a logarithm passes on one CPU and fails on another (a
different SIMD path rounds differently, and after a log a tiny difference at a quiet bin is large)."""
from __future__ import annotations

import numpy as np

# float32 pipelines computed in a different order (onnxruntime vs torch, batched vs one lane, AVX2
# vs AVX-512): a few float32 ulps of the peak per operation; a real mismatch is orders above it.
REL_PEAK = 1e-4


def _arr(x) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.complex128 if np.iscomplexobj(x) else np.float64)


def peak(x) -> float:
    return float(np.max(np.abs(_arr(x)))) if np.size(x) else 0.0


def assert_close_to_peak(got, ref, rel: float = REL_PEAK, plus: float = 0.0, err_msg: str = "") -> None:
    """max |got - ref| <= rel * peak(ref) + plus. `plus` is for a quantisation step of the format
    (e.g. half an LSB of 16-bit PCM), never a fudge on the level."""
    got, ref = _arr(got), _arr(ref)
    assert got.shape == ref.shape, (got.shape, ref.shape, err_msg)
    bound = rel * peak(ref) + plus
    worst = float(np.max(np.abs(got - ref))) if got.size else 0.0
    assert worst <= bound, f"{err_msg} max |diff| {worst:.3g} > {bound:.3g} ({rel:g} of the peak {peak(ref):.3g} + {plus:g})"


def assert_differs(got, ref, rel: float = 1e-3, err_msg: str = "") -> None:
    """The signals really differ: max |got - ref| > rel * peak(ref)."""
    worst = float(np.max(np.abs(_arr(got) - _arr(ref))))
    assert worst > rel * peak(ref), f"{err_msg} max |diff| {worst:.3g} <= {rel:g} of the peak {peak(ref):.3g}"


def snr_db(ref, got) -> float:
    """Energy of `ref` over the energy of `got - ref`, in dB (inf when identical)."""
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    d = float(np.sum((got - ref) ** 2))
    return float("inf") if d == 0 else float(10 * np.log10(np.sum(ref ** 2) / d))
