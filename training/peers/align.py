"""Sample-exact alignment for the peer benchmark: resampling, delay removal, delay estimation.

Every peer is scored against the clean reference sample for sample, so each output must have the
input's length and no delay. `fit` drops a known delay and trims or zero-pads to a length;
`estimate_delay` finds a delay by cross-correlating an output with its input (how the delays
declared in `adapters` were measured, and how `bench-peers --measure-delays` checks them).
"""
from __future__ import annotations

import numpy as np
import soxr


def as_mono(audio) -> np.ndarray:
    """(n,) or (n, channels) -> float32 (n,) (the first channel)."""
    a = np.asarray(audio)
    if a.ndim == 2:
        a = a[:, 0]
    if a.ndim != 1:
        raise ValueError(f"expected mono audio (n,) or (n, channels), got shape {a.shape}")
    return np.ascontiguousarray(a, dtype=np.float32)


def fit(y: np.ndarray, delay: int, length: int) -> np.ndarray:
    """Drop the first `delay` samples, then trim or zero-pad to `length`."""
    if delay < 0:
        raise ValueError(f"delay must be >= 0, got {delay}")
    y = np.asarray(y, dtype=np.float32).reshape(-1)[delay:delay + length]
    if len(y) < length:
        y = np.concatenate([y, np.zeros(length - len(y), np.float32)])
    return y


def resample(x: np.ndarray, sr_in: int, sr_out: int, length: int | None = None) -> np.ndarray:
    """soxr (HQ, delay-compensated) resampling to exactly `length` samples (default: n * sr_out / sr_in)."""
    x = np.asarray(x, dtype=np.float32)
    if length is None:
        length = int(round(len(x) * sr_out / sr_in))
    if sr_in != sr_out and len(x):
        x = soxr.resample(x, sr_in, sr_out, quality="HQ").astype(np.float32, copy=False)
    return fit(x, 0, length)


def estimate_delay(reference: np.ndarray, output: np.ndarray, max_delay: int) -> int:
    """Lag in samples (-max_delay..max_delay) at which `output` best matches `reference`.

    Positive: the output trails the input. Uses the peak of the FFT cross-correlation, so it
    works for any linear-phase-ish processing that keeps most of the reference (a denoiser fed
    with clean speech)."""
    r = np.asarray(reference, np.float64).reshape(-1)
    o = np.asarray(output, np.float64).reshape(-1)
    n = len(r) + len(o) - 1
    nfft = 1 << (n - 1).bit_length()
    xc = np.fft.irfft(np.fft.rfft(o, nfft) * np.conj(np.fft.rfft(r, nfft)), nfft)  # xc[k] = sum o[t+k] r[t]
    lags = np.arange(-max_delay, max_delay + 1)
    return int(lags[np.argmax(xc[lags % nfft])])


def measure_delay(peer, audio, sample_rate: int, max_ms: float = 60.0) -> int:
    """The delay of `peer.process` (samples at `peer.rate`) on `audio` (clean speech works best)."""
    x = resample(as_mono(audio), sample_rate, peer.rate)
    pad = int(peer.rate * max_ms / 1000)
    padded = np.concatenate([x, np.zeros(pad, np.float32)])
    return estimate_delay(padded, peer.process(padded), pad)
