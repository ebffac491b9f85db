"""Augmentations of a training example, each a pure function of a random generator and its inputs.

The training mixer (`training.data.synthesis.Synthesizer`) calls them when `MixConfig` switches them on (all are
off by default, so runs started before they existed resume unchanged; `fit --augment` switches on the
recipe of the shipped model, `fit --mix KEY=VALUE` any single setting):

* **reverb** (`p_reverb`): a simulated room impulse response: a direct path, then exponentially
  decaying Gaussian noise with a random RT60 and direct-to-reverberant ratio. The mixture gets the
  fully reverberant speech; the *target* is the speech through the direct path and the first
  `early_ms` of reflections (the DNS-Challenge practice: the model removes late reverberation, not
  the room's colour).
* **EQ** (`p_eq_speech`, `p_eq_noise`): a smooth random gain over log-frequency (a tilt plus a few
  cosine bumps, at most `eq_db`), as microphones and rooms colour a voice; speech EQ applies to the
  target as well (the model is not asked to undo a microphone).
* **speed** (`p_speed`): speech resampled by a factor in `speed` (tempo and pitch together): more
  voices from the same talkers. The speech bandwidth scales with it.
* **band-limiting** (`p_bandlimit`): mixture and target low-passed at 3.4, 4, 5.5 or 7 kHz (telephone
  and narrow-band codecs); the loss ignores the bins above the cut.
* **clipping** (`p_clip`): the mixture driven into hard clipping (the target stays clean).
* **procedural noise** (`p_procedural` of the noise draws): coloured noise (1/f^beta), amplitude-
  modulated noise, mains hum with harmonics, clicks and crackle, beeping tones: categories the real
  recordings cover thinly.
* **a second noise** (`p_second_noise`): another noise draw added 0-10 dB below the first, so that
  many examples hold two kinds of noise at once (a café with music, traffic with wind).
* **noise speed** (`p_speed_noise` of the recorded noise and music draws): the excerpt played a factor
  in `speed_noise` faster (tempo and pitch together, 0.7-1.4x by default): engines, fans, voices of
  machines and music at other pitches and rates, more noises from the same recordings.
"""
from __future__ import annotations

import math

import numpy as np
import scipy.fft
from scipy.signal import fftconvolve

from enhancer.config import SAMPLE_RATE

BANDLIMITS_HZ = (3400.0, 4000.0, 5500.0, 7000.0)


# --------------------------------------------------------------------------- filters
EQ_GRID = 513  # the EQ curve is drawn on this many points and interpolated to the rfft bins


def smooth_eq_gain(rng: np.random.Generator, n_bins: int, max_db: float) -> np.ndarray:
    """(n_bins,) linear gains for the bins of an rfft: a tilt plus up to three cosine bumps over
    log-frequency, within +-max_db; 0 dB at DC. The curve is smooth (at most 3 periods over the
    band), so it is evaluated on `EQ_GRID` points and interpolated linearly."""
    grid = min(n_bins, EQ_GRID)
    f = np.linspace(0.0, SAMPLE_RATE / 2, grid)
    u = np.log2(np.maximum(f, 50.0) / 50.0) / math.log2(SAMPLE_RATE / 2 / 50.0)  # 0 at <= 50 Hz, 1 at Nyquist
    db = rng.uniform(-1.0, 1.0) * u  # tilt
    for _ in range(int(rng.integers(1, 4))):
        db += rng.uniform(-1.0, 1.0) * np.cos(2 * math.pi * (rng.uniform(0.5, 3.0) * u + rng.uniform(0.0, 1.0)))
    peak = np.abs(db).max()
    if peak > 0:
        db *= max_db * rng.uniform(0.3, 1.0) / peak
    gain = 10.0 ** (db / 20.0)
    if grid < n_bins:
        gain = np.interp(np.linspace(0.0, SAMPLE_RATE / 2, n_bins), f, gain)
    return gain.astype(np.float32)


def rfft(x: np.ndarray) -> np.ndarray:
    """Single-precision rfft (scipy keeps float32 in float32; numpy computes in float64)."""
    return scipy.fft.rfft(np.asarray(x, np.float32))


def irfft(spec: np.ndarray, n: int) -> np.ndarray:
    return scipy.fft.irfft(spec, n=n).astype(np.float32, copy=False)


def equalize(x: np.ndarray, gains: np.ndarray) -> np.ndarray:
    spec = rfft(x)
    return irfft(spec * gains[: len(spec)], len(x))


def random_eq(rng: np.random.Generator, x: np.ndarray, max_db: float) -> np.ndarray:
    return equalize(x, smooth_eq_gain(rng, len(x) // 2 + 1, max_db))


def lowpass(x: np.ndarray, cutoff_hz: float, transition_hz: float = 300.0) -> np.ndarray:
    """Zero-phase low-pass with a raised-cosine transition ending at `cutoff_hz`."""
    n = len(x)
    spec = rfft(x)
    f = np.fft.rfftfreq(n, 1.0 / SAMPLE_RATE)
    lo = cutoff_hz - transition_hz
    w = np.clip((cutoff_hz - f) / transition_hz, 0.0, 1.0)
    w = 0.5 - 0.5 * np.cos(math.pi * w)
    w[f <= lo] = 1.0
    return irfft(spec * w.astype(np.float32), n)


# --------------------------------------------------------------------------- reverb
def room_impulse_response(rng: np.random.Generator, rt60: float, drr_db: float) -> np.ndarray:
    """A direct path at t=0 followed by exponentially decaying noise (energy -60 dB after `rt60` s),
    scaled so that direct / reverberant energy = `drr_db`."""
    length = int(min(rt60, 1.5) * SAMPLE_RATE)
    t = np.arange(1, length) / SAMPLE_RATE
    tail = rng.standard_normal(length - 1) * np.exp(-3.0 * math.log(10.0) * t / rt60)
    pre = int(rng.integers(int(0.002 * SAMPLE_RATE), int(0.008 * SAMPLE_RATE)))  # first reflection delay
    tail[:pre] = 0.0
    e = float(np.sum(tail ** 2))
    if e > 0:
        tail *= math.sqrt(10.0 ** (-drr_db / 10.0) / e)
    return np.concatenate([[1.0], tail])


def reverberate(rng: np.random.Generator, x: np.ndarray, rt60: tuple[float, float], drr_db: tuple[float, float],
                early_ms: float) -> tuple[np.ndarray, np.ndarray]:
    """(reverberant, target) of the same length as x: x through the whole response, and through the
    direct path plus the first `early_ms` of reflections."""
    h = room_impulse_response(rng, float(rng.uniform(*rt60)), float(rng.uniform(*drr_db)))
    early = int(early_ms * 1e-3 * SAMPLE_RATE)
    x, h = np.asarray(x, np.float32), h.astype(np.float32)
    wet = fftconvolve(x, h)[: len(x)]
    target = fftconvolve(x, h[:early])[: len(x)]
    return wet.astype(np.float32, copy=False), target.astype(np.float32, copy=False)


# --------------------------------------------------------------------------- speed
def change_speed(x: np.ndarray, factor: float) -> np.ndarray:
    """Play x `factor` times faster (tempo and pitch): len(x) / factor samples."""
    import soxr

    return soxr.resample(np.asarray(x, np.float32), SAMPLE_RATE * factor, SAMPLE_RATE, quality="HQ").astype(np.float32)


# --------------------------------------------------------------------------- clipping
def hard_clip(rng: np.random.Generator, x: np.ndarray) -> np.ndarray:
    """Clip at a level that cuts the top 0.1-3 % of samples by magnitude."""
    a = np.abs(x)
    if not a.max() > 0:
        return x
    level = float(np.quantile(a, 1.0 - rng.uniform(0.001, 0.03)))
    return np.clip(x, -level, level).astype(np.float32)


# --------------------------------------------------------------------------- procedural noise
PROCEDURAL_KINDS = ("coloured", "modulated", "hum", "clicks", "tones")


def procedural_noise(rng: np.random.Generator, n: int, kind: str | None = None) -> tuple[np.ndarray, str]:
    """(n,) float32 noise of unit-ish RMS and its kind."""
    kind = kind or PROCEDURAL_KINDS[int(rng.integers(len(PROCEDURAL_KINDS)))]
    t = np.arange(n) / SAMPLE_RATE
    if kind in ("coloured", "modulated"):
        x = coloured_noise(rng, n, float(rng.uniform(-1.0, 2.0)))
        if kind == "modulated":
            rate = rng.uniform(0.3, 8.0)
            depth = rng.uniform(0.5, 1.0)
            x *= 1.0 - depth * 0.5 * (1.0 + np.sin(2 * math.pi * rate * t + rng.uniform(0, 2 * math.pi)))
    elif kind == "hum":
        f0 = float(rng.choice([50.0, 60.0])) * rng.uniform(0.99, 1.01)
        x = np.zeros(n)
        for k in range(1, int(rng.integers(3, 16))):
            if k * f0 >= SAMPLE_RATE / 2:
                break
            x += rng.uniform(0.05, 1.0) / k ** rng.uniform(0.0, 1.0) * np.sin(2 * math.pi * k * f0 * t + rng.uniform(0, 2 * math.pi))
        x += 0.01 * coloured_noise(rng, n, 1.0)
    elif kind == "clicks":
        x = np.zeros(n)
        k = int(rng.integers(5, max(6, n // 400)))
        pos = rng.integers(0, n, size=k)
        x[pos] = rng.standard_normal(k) * rng.uniform(0.2, 1.0, size=k)
        h = rng.standard_normal(int(rng.integers(8, 160)))  # each click rings briefly
        x = fftconvolve(x, h * np.exp(-np.arange(len(h)) / max(len(h) / 4, 1)))[:n]
        x += 10 ** rng.uniform(-3, -1.5) * coloured_noise(rng, n, 0.0)
    elif kind == "tones":
        x = np.zeros(n)
        for _ in range(int(rng.integers(1, 4))):
            f = rng.uniform(300.0, 4000.0)
            period = int(rng.uniform(0.1, 1.0) * SAMPLE_RATE)
            on = rng.uniform(0.2, 0.8)
            gate = ((np.arange(n) + int(rng.integers(period))) % period) < on * period
            x += gate * np.sin(2 * math.pi * f * t)
        x += 10 ** rng.uniform(-3, -1.5) * coloured_noise(rng, n, 1.0)
    else:
        raise ValueError(f"unknown procedural noise kind {kind!r} (one of {', '.join(PROCEDURAL_KINDS)})")
    rms = float(np.sqrt(np.mean(x ** 2)))
    return (x / max(rms, 1e-12)).astype(np.float32), kind


def coloured_noise(rng: np.random.Generator, n: int, beta: float) -> np.ndarray:
    """Gaussian noise with a 1/f^beta power spectrum (0 white, 1 pink, 2 brown, -1 blue), unit RMS."""
    spec = np.fft.rfft(rng.standard_normal(n))
    f = np.fft.rfftfreq(n, 1.0 / SAMPLE_RATE)
    spec *= np.maximum(f, 20.0) ** (-beta / 2.0)
    x = np.fft.irfft(spec, n=n)
    return x / max(float(np.sqrt(np.mean(x ** 2))), 1e-12)
