"""Training examples synthesised on the fly, and the fixed validation set.

Example `i` of a stream is a pure function of (seed, i): a random generator seeded with both draws
everything, so a resumed or sharded run sees exactly the examples it would have seen, and two
runs with one seed see the same data.

Clean speech is drawn by source, then by group (speaker or voice) within the source, then by clip:
a source's weight is sqrt(number of its groups) by default, so a few voices with thousands of
prompts (the G.722 IVR voices) or one long folder do not dominate, while the many-speaker sources
still count most. Short clips of one group are concatenated with short gaps to fill a segment, and a white noise
floor 60-80 dB below the speech level is added (as in any real recording).
The noise is a noise clip or a music clip (looped or cropped) or a babble of other training
talkers; a share of examples is noise-free. Each example carries its clean bandwidth: the loss
ignores bins above it (the G.722 material has nothing above 7 kHz).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .audio_cache import SAMPLE_RATE, AudioSet
from .manifests import DataError
from .mixing import active_rms, concatenate, fit_length, mix

MIN_NOISE_RMS = 1e-4  # -80 dBFS: quieter noise excerpts (silent parts of effects) are redrawn


@dataclass(frozen=True)
class MixConfig:
    segment_seconds: float = 2.0
    snr_db: tuple[float, float] = (0.0, 40.0)
    level_db: tuple[float, float] = (-35.0, -15.0)
    p_clean: float = 0.05  # noise-free examples
    p_music: float = 0.2  # noise is music ...
    p_babble: float = 0.15  # ... or babble; otherwise a noise clip
    babble_talkers: tuple[int, int] = (3, 7)  # inclusive range
    gap_seconds: tuple[float, float] = (0.05, 0.4)  # silence between concatenated clips
    # white noise floor under the clean speech, in dB below its active level: real recordings have
    # one, and digital silence (gaps, padded prompts) would otherwise dominate the log-magnitude loss
    floor_db: tuple[float, float] = (60.0, 80.0)
    source_weights: dict[str, float] = field(default_factory=dict)  # override the sqrt(groups) rule

    @property
    def segment_samples(self) -> int:
        return int(round(self.segment_seconds * SAMPLE_RATE))

    def validate(self) -> "MixConfig":
        if self.segment_seconds <= 0.1:
            raise ValueError(f"segment_seconds must be > 0.1, got {self.segment_seconds}")
        for name in ("snr_db", "level_db", "gap_seconds", "babble_talkers", "floor_db"):
            lo, hi = getattr(self, name)
            if lo > hi:
                raise ValueError(f"{name}: low {lo} > high {hi}")
        if self.level_db[1] > 0:
            raise ValueError("level_db must be <= 0 dBFS")
        if not 0 <= self.p_clean <= 1 or not 0 <= self.p_music + self.p_babble <= 1:
            raise ValueError("probabilities must lie in [0, 1] (p_music + p_babble <= 1)")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MixConfig":
        d = dict(d)
        for k in ("snr_db", "level_db", "babble_talkers", "gap_seconds", "floor_db"):
            if k in d:
                d[k] = tuple(d[k])
        return cls(**d).validate()


class Pool:
    """Draws clips of an `AudioSet` by source, then group, then clip."""

    def __init__(self, audio: AudioSet, source_weights: dict[str, float] | None = None):
        if not len(audio):
            raise DataError("empty audio set")
        self.audio = audio
        groups: dict[str, list[int]] = {}
        for i, it in enumerate(audio.items):
            groups.setdefault(it.group or "-", []).append(i)
        self.group_names = sorted(groups)
        self.group_clips = [np.array(groups[g]) for g in self.group_names]
        sources: dict[str, list[int]] = {}
        for gi, g in enumerate(self.group_names):
            sources.setdefault(g.split()[0] if g.strip() else "-", []).append(gi)
        self.source_names = sorted(sources)
        self.source_groups = [np.array(sources[s]) for s in self.source_names]
        w = np.array([math.sqrt(len(sources[s])) for s in self.source_names])
        for s, v in (source_weights or {}).items():
            if s in self.source_names:
                w[self.source_names.index(s)] = float(v)
        if not w.sum() > 0:
            raise DataError("source weights sum to zero")
        self.source_p = w / w.sum()

    def group(self, rng: np.random.Generator, exclude: int | None = None) -> int:
        for _ in range(8):
            s = rng.choice(len(self.source_names), p=self.source_p)
            g = int(rng.choice(self.source_groups[s]))
            if g != exclude or len(self.group_names) == 1:
                return g
        return g

    def clip(self, rng: np.random.Generator, group: int) -> int:
        return int(rng.choice(self.group_clips[group]))

    def shares(self) -> dict[str, float]:
        return dict(zip(self.source_names, self.source_p.round(3).tolist()))


@dataclass
class Example:
    noisy: np.ndarray  # (N,) float32
    clean: np.ndarray  # (N,) float32
    bandwidth_hz: float
    info: dict


class Synthesizer:
    """Example i of the stream (seed, stream): `Synthesizer(...).example(i)`. Stream 0 trains,
    stream 1 estimates the feature statistics."""

    def __init__(self, speech: AudioSet, noise: AudioSet, music: AudioSet | None, cfg: MixConfig, seed: int = 0,
                 stream: int = 0):
        self.cfg = cfg.validate()
        self.seed, self.stream = int(seed), int(stream)
        self.speech = Pool(speech, cfg.source_weights)
        self.noise = Pool(noise)
        self.music = Pool(music) if music is not None and len(music) else None

    def rng(self, index: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence([self.seed, self.stream, int(index)]))

    def speech_segment(self, rng: np.random.Generator, n: int, group: int | None = None):
        """A length-n segment of one group: clips with gaps, randomly cropped. -> (x, group, bandwidth)"""
        pool, sets = self.speech, self.speech.audio
        g = pool.group(rng) if group is None else group
        lo, hi = (int(s * SAMPLE_RATE) for s in self.cfg.gap_seconds)
        clips, gaps, total, bw = [], [], 0, math.inf
        while total < n:
            i = pool.clip(rng, g)
            c = sets.clip(i)
            if len(c) > n:  # a long clip: only a piece of it is needed
                start = int(rng.integers(0, len(c) - n + 1))
                c = c[start:start + n]
            clips.append(c)
            bw = min(bw, sets.items[i].bandwidth_hz or SAMPLE_RATE / 2)
            total += len(c)
            if total < n:
                gaps.append(int(rng.integers(lo, hi + 1)))
                total += gaps[-1]
        x = fit_length(concatenate(clips, gaps), n, rng)
        return x, g, bw

    def noise_segment(self, rng: np.random.Generator, n: int, exclude_group: int):
        """(noise (n,), kind) or (None, "none") when ten draws in a row gave a (near-)silent excerpt."""
        for _ in range(10):
            x, kind = self._noise_draw(rng, n, exclude_group)
            if active_rms(x) > MIN_NOISE_RMS:
                return x, kind
        return None, "none"

    def _noise_draw(self, rng: np.random.Generator, n: int, exclude_group: int):
        r = rng.random()
        if self.music is not None and r < self.cfg.p_music:
            return fit_length(self.music.audio.clip(self.music.clip(rng, self.music.group(rng))), n, rng), "music"
        if r < self.cfg.p_music + self.cfg.p_babble:
            k = int(rng.integers(self.cfg.babble_talkers[0], self.cfg.babble_talkers[1] + 1))
            babble = np.zeros(n, np.float64)
            for _ in range(k):
                x, _, _ = self.speech_segment(rng, n, self.speech.group(rng, exclude=exclude_group))
                babble += x / max(float(np.sqrt(np.mean(x.astype(np.float64) ** 2))), 1e-8)
            return babble.astype(np.float32), "babble"
        return fit_length(self.noise.audio.clip(self.noise.clip(rng, self.noise.group(rng))), n, rng), "noise"

    def example(self, index: int) -> Example:
        cfg, n = self.cfg, self.cfg.segment_samples
        rng = self.rng(index)
        for _ in range(10):  # a crop of a concatenation can, rarely, hold only silence
            clean, g, bw = self.speech_segment(rng, n)
            if np.abs(clean).max() > 1e-5:
                break
        else:
            raise DataError(f"example {index}: could not draw non-silent speech (is the speech cache silent?)")
        floor = float(rng.uniform(*cfg.floor_db))
        clean = clean + rng.standard_normal(n).astype(np.float32) * np.float32(active_rms(clean) * 10.0 ** (-floor / 20.0))
        snr = float(rng.uniform(*cfg.snr_db))
        level = float(rng.uniform(*cfg.level_db))
        if rng.random() < cfg.p_clean:
            noise, kind = None, "none"
        else:
            noise, kind = self.noise_segment(rng, n, g)
        noisy, clean = mix(clean, noise, snr, level)
        info = {"group": self.speech.group_names[g], "noise": kind, "snr_db": snr if noise is not None else math.inf,
                "level_db": level}
        return Example(noisy, clean, float(bw), info)

    def batch(self, indices) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """noisy (B, N), clean (B, N), bandwidth_hz (B,)."""
        ex = [self.example(i) for i in indices]
        return (np.stack([e.noisy for e in ex]), np.stack([e.clean for e in ex]),
                np.array([e.bandwidth_hz for e in ex], np.float32))


# --------------------------------------------------------------------------- validation set
VALID_SEED = 99991  # the validation stream never shares examples with a training stream


def validation_set(speech: AudioSet, noise: AudioSet, music: AudioSet | None, cfg: MixConfig, n_examples: int,
                   seconds: float, cache_dir=None, log=print) -> dict[str, np.ndarray]:
    """A fixed set of `n_examples` examples of `seconds` each from the validation speakers and
    noises; built once and stored in `cache_dir` (keyed by the data and settings), so every run on
    the same data is scored on the same examples. -> {noisy (K, N), clean (K, N), bandwidth_hz (K,)}"""
    vcfg = MixConfig.from_dict({**cfg.to_dict(), "segment_seconds": seconds})
    key_src = json.dumps([_set_key(speech), _set_key(noise), _set_key(music), vcfg.to_dict(), n_examples, VALID_SEED])
    key = hashlib.sha1(key_src.encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"valid-{key}.npz" if cache_dir is not None else None
    if path is not None and path.is_file():
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    synth = Synthesizer(speech, noise, music, vcfg, seed=VALID_SEED)
    noisy, clean, bw = synth.batch(range(n_examples))
    data = {"noisy": noisy, "clean": clean, "bandwidth_hz": bw}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}.npz")
        np.savez(tmp, **data)
        os.replace(tmp, path)
        log(f"validation set: {n_examples} x {seconds:g} s written to {path}")
    return data


def _set_key(s: AudioSet | None) -> str:
    if s is None or not len(s):
        return "-"
    h = hashlib.sha1()
    for it, n in zip(s.items, s.lengths):
        h.update(f"{it.path}|{it.group}|{it.bandwidth_hz}|{n}".encode())
    return h.hexdigest()
