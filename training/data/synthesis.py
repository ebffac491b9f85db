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
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from enhancer.config import SAMPLE_RATE

from . import augment
from .audio_cache import AudioSet
from .manifests import DataError
from .mixing import active_rms, concatenate, fit_length, limit_peak, mix

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
    noise_weights: dict[str, float] = field(default_factory=dict)  # the same for the noise clips' sources
    # augmentations (training.data.augment), all off by default; AUGMENT_RECIPE switches them on
    p_reverb: float = 0.0
    rt60_s: tuple[float, float] = (0.2, 1.0)
    drr_db: tuple[float, float] = (-2.0, 15.0)
    early_ms: float = 50.0
    p_eq_speech: float = 0.0
    p_eq_noise: float = 0.0
    eq_db: float = 8.0
    p_speed: float = 0.0
    speed: tuple[float, float] = (0.88, 1.12)
    p_bandlimit: float = 0.0
    p_clip: float = 0.0
    p_procedural: float = 0.0  # of the noise-clip draws
    p_second_noise: float = 0.0
    p_speed_noise: float = 0.0  # of the recorded noise and music draws
    speed_noise: tuple[float, float] = (0.7, 1.4)

    @property
    def segment_samples(self) -> int:
        return int(round(self.segment_seconds * SAMPLE_RATE))

    def validate(self) -> MixConfig:
        if self.segment_seconds <= 0.1:
            raise ValueError(f"segment_seconds must be > 0.1, got {self.segment_seconds}")
        for name in TUPLE_FIELDS:
            lo, hi = getattr(self, name)
            if lo > hi:
                raise ValueError(f"{name}: low {lo} > high {hi}")
        if self.level_db[1] > 0:
            raise ValueError("level_db must be <= 0 dBFS")
        if not 0 <= self.p_clean <= 1 or not 0 <= self.p_music + self.p_babble <= 1:
            raise ValueError("probabilities must lie in [0, 1] (p_music + p_babble <= 1)")
        for name in ("p_reverb", "p_eq_speech", "p_eq_noise", "p_speed", "p_bandlimit", "p_clip", "p_procedural",
                     "p_second_noise", "p_speed_noise"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)}")
        for name in ("source_weights", "noise_weights"):
            if any(not (float(v) >= 0 and math.isfinite(float(v))) for v in getattr(self, name).values()):
                raise ValueError(f"{name}: weights must be finite and >= 0, got {getattr(self, name)}")
        if self.speed[0] <= 0 or self.speed_noise[0] <= 0 or self.rt60_s[0] <= 0:
            raise ValueError("speed, speed_noise and rt60_s must be > 0")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> MixConfig:
        d = dict(d)
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown mixing setting(s): {', '.join(sorted(unknown))}")
        for k in TUPLE_FIELDS:
            if k in d:
                d[k] = tuple(d[k])
        return cls(**d).validate()


TUPLE_FIELDS = ("snr_db", "level_db", "gap_seconds", "babble_talkers", "floor_db", "rt60_s", "drr_db", "speed",
                "speed_noise")

# `fit --augment`: the augmentation recipe of the shipped model (see the model card)
AUGMENT_RECIPE = {
    "p_reverb": 0.25, "p_eq_speech": 0.5, "p_eq_noise": 0.5, "p_speed": 0.3, "p_bandlimit": 0.1, "p_clip": 0.03,
    "p_procedural": 0.12, "p_second_noise": 0.2, "p_music": 0.3, "p_babble": 0.15, "babble_talkers": (3, 12),
    "level_db": (-42.0, -12.0),
}


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
        self.noise = Pool(noise, cfg.noise_weights)
        unknown = sorted(set(cfg.noise_weights) - set(self.noise.source_names))
        if unknown:
            raise DataError(f"noise weights name source(s) the noise set lacks: {', '.join(unknown)} "
                            f"(its sources: {', '.join(self.noise.source_names)})")
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
        x, kind = self._one_noise(rng, n, exclude_group)
        cfg = self.cfg
        if cfg.p_eq_noise > 0 and rng.random() < cfg.p_eq_noise:
            x = augment.random_eq(rng, x, cfg.eq_db)
        if cfg.p_second_noise > 0 and rng.random() < cfg.p_second_noise:
            y, kind2 = self._one_noise(rng, n, exclude_group)
            ry, rx = active_rms(y), active_rms(x)
            if ry > 0 and rx > 0:
                x = (x + y * np.float32(rx / ry * 10.0 ** (-rng.uniform(0.0, 10.0) / 20.0))).astype(np.float32)
                kind = f"{kind}+{kind2}"
        return x, kind

    def _one_noise(self, rng: np.random.Generator, n: int, exclude_group: int):
        r = rng.random()
        if self.music is not None and r < self.cfg.p_music:
            return self._recorded(rng, self.music, n, "music")
        if r < self.cfg.p_music + self.cfg.p_babble:
            k = int(rng.integers(self.cfg.babble_talkers[0], self.cfg.babble_talkers[1] + 1))
            babble = np.zeros(n, np.float64)
            for _ in range(k):
                x, _, _ = self.speech_segment(rng, n, self.speech.group(rng, exclude=exclude_group))
                babble += x / max(float(np.sqrt(np.mean(x.astype(np.float64) ** 2))), 1e-8)
            return babble.astype(np.float32), "babble"
        if self.cfg.p_procedural > 0 and rng.random() < self.cfg.p_procedural:
            x, kind = augment.procedural_noise(rng, n)
            return x, f"procedural {kind}"
        return self._recorded(rng, self.noise, n, "noise")

    def _recorded(self, rng: np.random.Generator, pool: Pool, n: int, kind: str):
        """A length-n excerpt of a recorded clip of `pool`, on `p_speed_noise` of the draws played a
        factor in `speed_noise` faster (tempo and pitch): more noises from the same recordings."""
        clip = pool.audio.clip(pool.clip(rng, pool.group(rng)))
        cfg = self.cfg
        if not (cfg.p_speed_noise > 0 and rng.random() < cfg.p_speed_noise):
            return fit_length(clip, n, rng), kind
        speed = float(rng.uniform(*cfg.speed_noise))
        x = fit_length(clip, int(math.ceil(n * speed)) + 16, rng)
        return fit_length(augment.change_speed(x, speed), n, rng), f"{kind} speed {speed:.2f}"

    def example(self, index: int) -> Example:
        cfg, n = self.cfg, self.cfg.segment_samples
        rng = self.rng(index)
        speed = float(rng.uniform(*cfg.speed)) if cfg.p_speed > 0 and rng.random() < cfg.p_speed else 1.0
        m = n if speed == 1.0 else int(math.ceil(n * speed)) + 16
        for _ in range(10):  # a crop of a concatenation can, rarely, hold only silence
            clean, g, bw = self.speech_segment(rng, m)
            if np.abs(clean).max() > 1e-5:
                break
        else:
            raise DataError(f"example {index}: could not draw non-silent speech (is the speech cache silent?)")
        aug = []
        if speed != 1.0:
            clean = fit_length(augment.change_speed(clean, speed), n, rng)
            bw = min(bw * speed, SAMPLE_RATE / 2)
            aug.append(f"speed {speed:.2f}")
        if cfg.p_eq_speech > 0 and rng.random() < cfg.p_eq_speech:
            clean = augment.random_eq(rng, clean, cfg.eq_db)
            aug.append("eq")
        floor = float(rng.uniform(*cfg.floor_db))
        clean = clean + rng.standard_normal(n).astype(np.float32) * np.float32(active_rms(clean) * 10.0 ** (-floor / 20.0))
        target = None
        if cfg.p_reverb > 0 and rng.random() < cfg.p_reverb:
            clean, target = augment.reverberate(rng, clean, cfg.rt60_s, cfg.drr_db, cfg.early_ms)
            aug.append("reverb")
        snr = float(rng.uniform(*cfg.snr_db))
        level = float(rng.uniform(*cfg.level_db))
        if rng.random() < cfg.p_clean:
            noise, kind = None, "none"
        else:
            noise, kind = self.noise_segment(rng, n, g)
        noisy, clean = mix(clean, noise, snr, level, target=target)
        if cfg.p_bandlimit > 0 and rng.random() < cfg.p_bandlimit:
            cut = float(augment.BANDLIMITS_HZ[int(rng.integers(len(augment.BANDLIMITS_HZ)))])
            # the filter's ringing can overshoot the mixer's limit
            noisy, clean = limit_peak(augment.lowpass(noisy, cut), augment.lowpass(clean, cut))
            bw = min(bw, cut)
            aug.append(f"lowpass {cut:g}")
        if cfg.p_clip > 0 and rng.random() < cfg.p_clip:
            noisy = augment.hard_clip(rng, noisy)
            aug.append("clip")
        info = {"group": self.speech.group_names[g], "noise": kind, "snr_db": snr if noise is not None else math.inf,
                "level_db": level, "augment": aug}
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
    # the validation noises are drawn by the default rule: a training run's noise weights name training sources
    vcfg = MixConfig.from_dict({**cfg.to_dict(), "segment_seconds": seconds, "noise_weights": {}})
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
