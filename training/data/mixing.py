"""One noisy/clean training example, the way the DNS-Challenge synthesizer makes them.

Levels are active RMS levels: the RMS over the 20 ms frames whose energy is within 40 dB of the
loudest frame, so pauses between words do not lower a talker's level. The SNR of a mixture is
`20 log10(active_rms(clean) / active_rms(noise))`; the speech level is the active RMS of the clean
speech in dB relative to full scale (1.0). If the mixture would clip, clean and noise are scaled down
together (the SNR is kept, the level drops).
"""
from __future__ import annotations

import numpy as np

FRAME = 320  # 20 ms at 16 kHz
ACTIVE_RANGE_DB = 40.0
PEAK_LIMIT = 0.99


def active_rms(x: np.ndarray, frame: int = FRAME, range_db: float = ACTIVE_RANGE_DB) -> float:
    """RMS over the frames within `range_db` of the loudest frame (0 for silence). x: (n,)."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x) // frame
    if n == 0:
        return float(np.sqrt(np.mean(x * x))) if len(x) else 0.0
    e = np.mean(x[: n * frame].reshape(n, frame) ** 2, axis=1)  # (n,) frame energies
    peak = e.max()
    if peak <= 0.0:
        return 0.0
    active = e >= peak * 10.0 ** (-range_db / 10.0)
    return float(np.sqrt(e[active].mean()))


def snr_db(clean: np.ndarray, noise: np.ndarray) -> float:
    """SNR as the mixer defines it (active RMS of each)."""
    return 20.0 * np.log10(active_rms(clean) / max(active_rms(noise), 1e-20))


def level_db(x: np.ndarray) -> float:
    """Active RMS level in dB relative to full scale."""
    return 20.0 * np.log10(max(active_rms(x), 1e-20))


def mix(clean: np.ndarray, noise: np.ndarray | None, snr: float, level: float,
        peak_limit: float = PEAK_LIMIT, target: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Scale `clean` to `level` dBFS and `noise` to `snr` dB below it; returns (noisy, clean),
    float32, with |noisy| and |clean| <= `peak_limit`. `noise=None` gives a noise-free example.
    `target`, when given, is what the model should recover from the speech in the mixture (e.g. its
    direct path when `clean` is reverberant): it gets the same gain as `clean` and is returned in
    its place."""
    clean = np.asarray(clean, dtype=np.float64)
    rc = active_rms(clean)
    if rc <= 0.0:
        raise ValueError("clean speech is silent")
    g = 10.0 ** (level / 20.0) / rc
    ref = None if target is None else np.asarray(target, dtype=np.float64) * g
    if ref is not None and ref.shape != clean.shape:
        raise ValueError(f"target {ref.shape} and clean {clean.shape} differ in length")
    clean = clean * g
    if noise is None:
        noisy = clean
    else:
        noise = np.asarray(noise, dtype=np.float64)
        if noise.shape != clean.shape:
            raise ValueError(f"noise {noise.shape} and clean {clean.shape} differ in length")
        rn = active_rms(noise)
        noisy = clean if rn <= 0.0 else clean + noise * (active_rms(clean) / rn / 10.0 ** (snr / 20.0))
    if ref is not None:
        clean = ref
    noisy, clean = limit_peak(noisy, clean, peak_limit)
    return noisy.astype(np.float32), clean.astype(np.float32)


def limit_peak(noisy: np.ndarray, clean: np.ndarray, peak_limit: float = PEAK_LIMIT) -> tuple[np.ndarray, np.ndarray]:
    """Scale both down together (the SNR is kept) when either exceeds `peak_limit`."""
    peak = max(float(np.abs(noisy).max()), float(np.abs(clean).max()))
    if peak > peak_limit:
        g = peak_limit / peak
        noisy, clean = noisy * g, clean * g
    return noisy, clean


def fit_length(x: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """A length-`n` excerpt: a random crop of a longer clip, or the clip looped from a random
    phase when it is shorter."""
    x = np.asarray(x)
    if len(x) >= n:
        start = int(rng.integers(0, len(x) - n + 1))
        return np.array(x[start:start + n])
    reps = -(-n // len(x)) + 1
    start = int(rng.integers(0, len(x)))
    return np.tile(x, reps)[start:start + n]


def concatenate(clips: list[np.ndarray], gaps: list[int]) -> np.ndarray:
    """clips[0], gaps[0] zeros, clips[1], ... (len(gaps) == len(clips) - 1)."""
    parts = []
    for i, c in enumerate(clips):
        parts.append(np.asarray(c, dtype=np.float32))
        if i < len(gaps):
            parts.append(np.zeros(gaps[i], np.float32))
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)
