"""`enhancer-train synth-noise`: procedurally generated noise files and a manifest, so that training
can start from a fresh clone (shared speech + this noise) without building the full corpus.

    enhancer-train synth-noise --out runs/noise        # writes runs/noise/*.wav and runs/noise/noise.tsv

Kinds (one manifest group each): white, pink (1/f), brown (1/f^2), hum (50/60 Hz and harmonics
over a little noise), fan (band-limited rumble with a slow wobble), rain (dense random clicks
through a high-pass), keyboard (sparse decaying clicks), beeps (tones switching on and off).
Every file is 16 kHz mono float WAV, normalised to -20 dBFS RMS (the mixer sets the SNR anyway);
the manifest has a `split` column (the last file of each kind is `valid`), which `fit --noise`
uses as the train/valid split.
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

from enhancer.config import SAMPLE_RATE

KINDS = ("white", "pink", "brown", "hum", "fan", "rain", "keyboard", "beeps")


def _shaped(n: int, rng, exponent: float) -> np.ndarray:
    """Gaussian noise with a power spectrum proportional to 1 / f^exponent."""
    spec = np.fft.rfft(rng.standard_normal(n))
    f = np.fft.rfftfreq(n, 1.0 / SAMPLE_RATE)
    f[0] = f[1]
    return np.fft.irfft(spec / f ** (exponent / 2), n)


def _lowpass(x: np.ndarray, hz: float) -> np.ndarray:
    spec = np.fft.rfft(x)
    spec[np.fft.rfftfreq(len(x), 1.0 / SAMPLE_RATE) > hz] = 0
    return np.fft.irfft(spec, len(x))


def _highpass(x: np.ndarray, hz: float) -> np.ndarray:
    spec = np.fft.rfft(x)
    spec[np.fft.rfftfreq(len(x), 1.0 / SAMPLE_RATE) < hz] = 0
    return np.fft.irfft(spec, len(x))


def _clicks(n: int, rng, rate_hz: float, decay_ms: float) -> np.ndarray:
    x = np.zeros(n)
    k = max(1, int(rate_hz * n / SAMPLE_RATE))
    x[rng.integers(0, n, k)] = rng.standard_normal(k)
    tail = np.exp(-np.arange(int(decay_ms * SAMPLE_RATE / 1000)) / (decay_ms * SAMPLE_RATE / 5000))
    return np.convolve(x, tail * rng.standard_normal(len(tail)), mode="same")


def synthesize(kind: str, seconds: float, seed: int) -> np.ndarray:
    """One noise clip of `kind`, float32 at 16 kHz, -20 dBFS RMS."""
    rng = np.random.default_rng(seed)
    n = int(seconds * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    if kind == "white":
        x = rng.standard_normal(n)
    elif kind == "pink":
        x = _shaped(n, rng, 1.0)
    elif kind == "brown":
        x = _shaped(n, rng, 2.0)
    elif kind == "hum":
        f0 = rng.choice([50.0, 60.0]) * rng.uniform(0.99, 1.01)
        x = sum(rng.uniform(0.2, 1.0) / k * np.sin(2 * np.pi * k * f0 * t + rng.uniform(0, 6.3)) for k in range(1, 12))
        x = x + 0.05 * rng.standard_normal(n)
    elif kind == "fan":
        x = _lowpass(rng.standard_normal(n), rng.uniform(300, 1500)) * (1 + 0.3 * np.sin(2 * np.pi * rng.uniform(0.2, 2) * t))
    elif kind == "rain":
        x = _highpass(_clicks(n, rng, rng.uniform(300, 2000), 3.0), rng.uniform(1000, 3000)) + 0.05 * rng.standard_normal(n)
    elif kind == "keyboard":
        x = _clicks(n, rng, rng.uniform(4, 12), 15.0)
    elif kind == "beeps":
        f = rng.uniform(400, 3000, 3)
        gate = (np.sin(2 * np.pi * rng.uniform(0.5, 3) * t) > rng.uniform(-0.3, 0.5)).astype(np.float64)
        x = gate * sum(np.sin(2 * np.pi * fk * t) for fk in f) + 0.01 * rng.standard_normal(n)
    else:
        raise ValueError(f"unknown noise kind {kind!r}; choose from {', '.join(KINDS)}")
    x = x - x.mean()
    rms = float(np.sqrt(np.mean(x ** 2)))
    return (x * (0.1 / rms)).astype(np.float32) if rms > 0 else x.astype(np.float32)


def write_noise_set(out, files_per_kind: int = 4, seconds: float = 10.0, seed: int = 0, kinds=KINDS,
                    progress: bool = True) -> Path:
    """Write `files_per_kind` clips of every kind under `out` and `out/noise.tsv` (split column:
    the last clip of each kind is `valid`). Returns the manifest's path."""
    import soundfile as sf
    from tqdm import tqdm

    if files_per_kind < 2:
        raise ValueError("--files-per-kind must be >= 2 (one of each kind is held out for validation)")
    if not seconds > 0:
        raise ValueError("--seconds must be > 0")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    jobs = [(k, i) for k in kinds for i in range(files_per_kind)]
    for j, (kind, i) in enumerate(tqdm(jobs, desc="synth-noise", unit="file", disable=not progress)):
        rel = f"{kind}/{kind}-{i}.wav"
        (out / kind).mkdir(exist_ok=True)
        sf.write(str(out / rel), synthesize(kind, seconds, seed * 100003 + j), SAMPLE_RATE, subtype="FLOAT")
        rows.append(("valid" if i == files_per_kind - 1 else "train", rel, f"{seconds:g}", SAMPLE_RATE, f"synth {kind}",
                     SAMPLE_RATE / 2))
    manifest = out / "noise.tsv"
    with open(manifest, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter="\t", lineterminator="\n")
        w.writerow(("split", "path", "seconds", "sample_rate", "group", "bandwidth_hz"))
        w.writerows(rows)
    return manifest


def add_synth_noise(sub) -> None:
    p = sub.add_parser("synth-noise", help="write procedurally generated noise files and a manifest",
                       description="Generated noise (" + ", ".join(KINDS) + ") for training without the full "
                                   "corpus: use the manifest with fit --noise.")
    p.add_argument("--out", type=Path, required=True, help="folder for the files and noise.tsv")
    p.add_argument("--files-per-kind", type=int, default=4, help="clips per kind, the last one for validation (default 4)")
    p.add_argument("--seconds", type=float, default=10.0, help="length of each clip (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_synth_noise)


def cmd_synth_noise(args: argparse.Namespace) -> int:
    import sys

    manifest = write_noise_set(args.out, args.files_per_kind, args.seconds, args.seed, progress=not args.quiet)
    if not args.quiet:
        print(f"wrote {args.files_per_kind * len(KINDS)} noise files and the manifest {manifest} "
              f"(use it with: enhancer-train fit --noise {manifest} ...)", file=sys.stderr)
    return 0
