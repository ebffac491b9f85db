"""Signal path in numpy: windows, STFT/iSTFT, log-magnitude features, resampling, input checks.

The torch twins live in `enhancer.build.model.features`; a test holds them equal. Framing convention
(shared with the streaming step): the signal is preceded by one hop of zeros, frame `n` covers
padded samples `[n*hop, n*hop + n_fft)`, so frame 0 holds one hop of zeros and the first hop.
"""
from __future__ import annotations

import math

import numpy as np

from .config import STFTConfig
from .errors import AudioError
from .resample import StreamResampler

MIN_RATE = 1000
MAX_RATE = 384000
# Float audio is expected in about [-1, 1] (full scale). Finite samples far beyond it still break
# the model: from about 1e17 its output overflows to NaN/Inf. The service uses the same bound.
MAX_ABS_SAMPLE = 1e6
MAX_CHANNELS = 64  # channels of one signal or stream (the service's max_channels is at most this)


def sqrt_hann(n: int) -> np.ndarray:
    """Periodic sqrt-Hann window; its square sums to exactly 1 at 50 % overlap."""
    return np.sqrt(0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n)).astype(np.float32)


def n_frames_for(n_samples: int, cfg: STFTConfig = STFTConfig()) -> int:
    """Frames needed so that every input sample is covered by two frames (fully reconstructed)."""
    return -(-n_samples // cfg.hop) + 1


def pad_for_stft(x: np.ndarray, n_frames: int, cfg: STFTConfig = STFTConfig()) -> np.ndarray:
    """One hop of zeros in front, zeros at the end up to `n_frames` frames. x: (..., n)."""
    total = (n_frames + 1) * cfg.hop
    end = total - cfg.hop - x.shape[-1]
    if end < 0:
        raise ValueError("n_frames too small for the signal")
    widths = [(0, 0)] * (x.ndim - 1) + [(cfg.hop, end)]
    return np.pad(x, widths)


def stft(x: np.ndarray, cfg: STFTConfig = STFTConfig(), n_frames: int | None = None) -> np.ndarray:
    """x: (..., n) float -> complex64 (..., frames, n_freqs)."""
    x = np.asarray(x, dtype=np.float32)
    n_frames = n_frames_for(x.shape[-1], cfg) if n_frames is None else n_frames
    xp = pad_for_stft(x, n_frames, cfg)
    idx = np.arange(n_frames)[:, None] * cfg.hop + np.arange(cfg.n_fft)[None, :]
    frames = xp[..., idx] * sqrt_hann(cfg.n_fft)  # (..., T, n_fft)
    return np.fft.rfft(frames, axis=-1).astype(np.complex64)


def istft(spec: np.ndarray, n_samples: int, cfg: STFTConfig = STFTConfig()) -> np.ndarray:
    """Inverse of `stft`: complex (..., T, F) -> float32 (..., n_samples)."""
    frames = np.fft.irfft(spec, n=cfg.n_fft, axis=-1).astype(np.float32) * sqrt_hann(cfg.n_fft)
    t = frames.shape[-2]
    out = np.zeros(frames.shape[:-2] + ((t + 1) * cfg.hop,), dtype=np.float32)
    # 50 % overlap: frames i, i+2, i+4 ... start at (i + 2k) * hop and are 2 * hop long, so each
    # parity class tiles the output back to back and is added with one reshape.
    for i in range(2):
        part = frames[..., i::2, :]
        n = part.shape[-2] * cfg.n_fft
        out[..., i * cfg.hop:i * cfg.hop + n] += part.reshape(part.shape[:-2] + (n,))
    return out[..., cfg.hop:cfg.hop + n_samples]


def log_magnitude(spec: np.ndarray, eps: float) -> np.ndarray:
    """log(|X| + eps), float32."""
    return np.log(np.abs(spec) + eps).astype(np.float32)


# --------------------------------------------------------------------------- input handling
def nonfinite_and_peak(x: np.ndarray) -> tuple[int, float]:
    """(number of NaN/Inf samples, peak |x|) of non-empty float audio, in one pass when all samples
    are finite (the peak is meaningless otherwise)."""
    peak = float(np.abs(x).max())
    if math.isfinite(peak):
        return 0, peak
    return int((~np.isfinite(x)).sum()), peak


def check_audio(audio: np.ndarray, name: str = "audio") -> np.ndarray:
    """Validate a waveform: shape (n,) or (n, channels), finite, within +-MAX_ABS_SAMPLE, non-empty.
    Returns float32."""
    a = np.asarray(audio)
    if a.dtype.kind not in "fiu":
        raise AudioError(f"{name}: expected a numeric array, got dtype {a.dtype}")
    if a.ndim not in (1, 2):
        raise AudioError(f"{name}: expected shape (samples,) or (samples, channels), got {a.shape}")
    if a.shape[0] == 0:
        raise AudioError(f"{name}: empty audio (0 samples)")
    if a.ndim == 2 and a.shape[1] == 0:
        raise AudioError(f"{name}: 0 channels")
    if a.ndim == 2 and a.shape[1] > MAX_CHANNELS:
        raise AudioError(f"{name}: {a.shape[1]} channels; is the array transposed? expected (samples, channels)")
    a = to_float32(a)
    bad, peak = nonfinite_and_peak(a)
    if bad:
        raise AudioError(f"{name}: {bad} sample(s) are NaN or Inf")
    if peak > MAX_ABS_SAMPLE:
        raise AudioError(f"{name}: sample values up to {peak:.3g}; float audio is expected in about [-1, 1] "
                         f"and must lie within +-{MAX_ABS_SAMPLE:g}")
    return a


def to_float32(a: np.ndarray) -> np.ndarray:
    """Integer PCM is scaled to [-1, 1); floats are cast."""
    if a.dtype.kind == "f":
        return a.astype(np.float32, copy=False)
    if a.dtype.kind == "u":  # unsigned 8-bit PCM is offset binary
        bits = a.dtype.itemsize * 8
        return ((a.astype(np.float32) - 2 ** (bits - 1)) / 2 ** (bits - 1)).astype(np.float32)
    bits = a.dtype.itemsize * 8
    return (a.astype(np.float32) / 2 ** (bits - 1)).astype(np.float32)


def check_rate(sample_rate: int) -> int:
    try:
        sr = int(sample_rate)
    except (TypeError, ValueError, OverflowError):
        raise AudioError(f"sample rate must be an integer, got {sample_rate!r}") from None
    if sr != sample_rate or not MIN_RATE <= sr <= MAX_RATE:
        raise AudioError(f"sample rate {sample_rate!r} Hz is outside the supported {MIN_RATE}..{MAX_RATE} Hz")
    return sr


def resample(x: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """(n,) or (n, channels) float32 audio at another rate, through the streams' filter
    (`enhancer.resample`) in one call: n * to_rate / from_rate samples (rounded), aligned."""
    if from_rate == to_rate:
        return x
    a = np.asarray(x, np.float32)
    y = StreamResampler(from_rate, to_rate, 1 if a.ndim == 1 else a.shape[1]).process(a, last=True)
    return y[:, 0] if a.ndim == 1 else y
