"""Full-band audio of a corpus (44.1 kHz and above): its rows, clips at `RATE`, and the checks the
full-band sets use (`training.peers.fullband` scores on the valid rows, `training.upperband`
trains on the train rows)."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import soxr

RATE = 44100  # clips are read at this rate
NOISE_UPPER_SHARE = 0.05  # a full-band noise has at least this share of its energy above 8 kHz
SPEECH_DB = -30.0  # speech frames: the clean's level within this of its loud frames (95th percentile)


def rows(data: Path, name: str) -> list[dict]:
    with open(data / "manifests" / name, newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def load(data: Path, path: str) -> np.ndarray:
    import soundfile as sf

    x, sr = sf.read(data / path, dtype="float32", always_2d=True)
    x = x.mean(axis=1)
    if sr != RATE:
        x = soxr.resample(x, sr, RATE, quality="VHQ").astype(np.float32)
    return x


def upper_share(x: np.ndarray) -> float:
    p = np.abs(np.fft.rfft(x)) ** 2
    f = np.fft.rfftfreq(len(x), 1.0 / RATE)
    return float(p[f > 8200].sum() / max(p.sum(), 1e-20))


def trim(x: np.ndarray) -> np.ndarray:
    """Drop leading/trailing near-silence (below -50 dB of the clip's peak, 10 ms frames)."""
    f = 441
    e = np.array([np.mean(x[i:i + f] ** 2) for i in range(0, len(x), f)])
    on = np.flatnonzero(e > e.max() * 1e-5)
    return x[on[0] * f:(on[-1] + 1) * f] if len(on) else x


def frame_levels(frame_power: np.ndarray) -> tuple[np.ndarray, float]:
    """Each frame's level in dB and the loud frames' level (their 95th percentile): speech frames
    are those at or above loud + SPEECH_DB."""
    level = 10 * np.log10(np.asarray(frame_power) + 1e-20)
    return level, np.percentile(level, 95)
