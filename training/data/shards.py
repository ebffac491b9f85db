"""A compact, portable copy of the decoded training corpus: compressed shards plus one index.

`enhancer-train pack` writes the 16 kHz audio of each set (speech, noise and music; train and
valid) as Ogg Opus or FLAC shards of at most `--shard-mb` MB each, whole clips back to back, and
`index.json` (the items of every set, where each clip lies in which shard, the sha256 of every
shard). The copy carries to a machine with no network and no corpus (a GPU machine), where
`enhancer-train fit --shards DIR` decodes it into memory (the shards may be spread over several
folders: `--shards A,B,C`, the index in any of them).

Opus keeps the sizes small (about 30 kbit/s at the default `--quality 0.9`, a sixth of FLAC): the
waveform is not bit-exact (Opus is perceptual; `index.json` records each set's waveform SNR of the
round trip), which does not matter for noise and music and is the practice of large public corpora
for the clean speech (read speech distributed as compressed audio). `--codec flac` keeps it exact.
"""
from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np

from enhancer.config import SAMPLE_RATE

from .audio_cache import AudioSet
from .corpus_sources import sha256_of as sha256
from .manifests import DataError, Item

FORMAT = "tim-enhancer-shards/1"
CODECS = {"opus": ("OGG", "OPUS", ".opus"), "flac": ("FLAC", "PCM_16", ".flac")}
SPLITS = ("train", "valid")


def _bits_per_second(codec: str, quality: float) -> float:
    """A planning estimate, used only to size the shards (the index records the real sizes)."""
    return 160_000.0 if codec == "flac" else 30_000.0 + 250_000.0 * (1.0 - quality) ** 2


def select(audio: AudioSet, max_hours: float | None, seed: int = 0) -> list[int]:
    """Indices of the clips to keep: all of them, or a seeded random subset of about `max_hours`
    (whole clips, spread over every group)."""
    n = len(audio)
    if max_hours is None or audio.seconds <= max_hours * 3600.0:
        return list(range(n))
    order = np.random.default_rng(seed).permutation(n)
    keep, total = [], 0
    for i in order:
        if total >= max_hours * 3600.0 * SAMPLE_RATE:
            break
        keep.append(int(i))
        total += int(audio.lengths[i])
    return sorted(keep)


def pack_set(audio: AudioSet, name: str, out: Path, codec: str = "opus", quality: float = 0.9,
             shard_mb: float = 30.0, max_hours: float | None = None, seed: int = 0, log=print) -> dict:
    """Write one set's shards into `out`; -> its entry of the index."""
    import soundfile as sf

    fmt, subtype, ext = CODECS[codec]
    keep = select(audio, max_hours, seed)
    per_shard = max(SAMPLE_RATE, int(shard_mb * 8e6 / _bits_per_second(codec, quality) * SAMPLE_RATE))
    groups, current, size = [], [], 0
    for i in keep:
        current.append(i)
        size += int(audio.lengths[i])
        if size >= per_shard:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)

    def write(k: int) -> tuple[dict, float, float]:
        x = np.concatenate([np.asarray(audio.clip(i), np.float32) for i in groups[k]])
        peak = float(np.abs(x).max()) if x.size else 0.0
        scale = 1.0 if peak <= 0.999 else 0.999 / peak  # the codecs clip at full scale
        path = out / f"{name}-{k:03d}{ext}"
        extra = {"compression_level": quality} if codec == "opus" else {}
        sf.write(str(path), x * np.float32(scale), SAMPLE_RATE, format=fmt, subtype=subtype, **extra)
        y, _ = sf.read(str(path), dtype="float32")
        if len(y) != len(x):
            raise DataError(f"{path}: decoded {len(y)} samples of {len(x)} (codec delay?); try --codec flac")
        y = y / np.float32(scale)
        shard = {"file": path.name, "samples": len(x), "gain": 1.0 / scale, "bytes": path.stat().st_size,
                 "sha256": sha256(path)}
        return shard, float(np.sum((y.astype(np.float64) - x) ** 2)), float(np.sum(x.astype(np.float64) ** 2))

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # libsndfile releases the GIL
        done = list(pool.map(write, range(len(groups))))
    shards = [d[0] for d in done]
    err, sig = sum(d[1] for d in done), sum(d[2] for d in done)
    clips = []
    for k, idx in enumerate(groups):
        off = 0
        for i in idx:
            n = int(audio.lengths[i])
            clips.append({"item": asdict(audio.items[i]), "shard": k, "offset": off, "length": n})
            off += n
    snr = 10.0 * math.log10(sig / err) if err > 0 else math.inf
    seconds = sum(c["length"] for c in clips) / SAMPLE_RATE
    mb = sum(s["bytes"] for s in shards) / 1e6
    log(f"{name}: {len(clips)} of {len(audio)} clips, {seconds / 3600:.2f} h in {len(shards)} shard(s), {mb:.1f} MB "
        f"({mb * 8e3 / max(seconds, 1e-9):.1f} kbit/s), round-trip SNR {snr:.1f} dB")
    return {"clips": clips, "shards": shards, "seconds": seconds, "snr_db": snr if math.isfinite(snr) else None,
            "codec": codec}


def _for_set(settings: dict, name: str, category: str, default=None):
    """A per-set setting: the set's own ("speech_train"), else its category's ("speech"), else `default`."""
    return settings.get(name, settings.get(category, default))


def pack(sets: dict[tuple[str, str], AudioSet], out, codec: str = "opus", quality: float = 0.9,
         shard_mb: float = 30.0, max_hours: dict[str, float] | None = None, seed: int = 0, log=print,
         codec_for: dict[str, str] | None = None) -> dict:
    """Pack every set {(category, split): AudioSet} into `out` (a new or empty folder). `codec_for`
    overrides the codec of a set or category, e.g. {"speech": "flac"}: lossless clean speech (the
    training target) beside Opus noise and music."""
    codec_for = dict(codec_for or {})
    for c in (codec, *codec_for.values()):
        if c not in CODECS:
            raise ValueError(f"codec must be one of {', '.join(CODECS)}, got {c!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    index = {"format": FORMAT, "sample_rate": SAMPLE_RATE, "codec": codec, "quality": quality, "sets": {}}
    for (cat, split), audio in sets.items():
        if audio is None or not len(audio):
            continue
        name = f"{cat}_{split}"
        hours = _for_set(max_hours or {}, name, cat)
        set_codec = _for_set(codec_for, name, cat, codec)
        index["sets"][name] = pack_set(audio, name, out, set_codec, quality, shard_mb, hours, seed, log)
    with open(out / "index.json", "w", encoding="utf-8") as f:
        json.dump(index, f)
    return index


def find_index(folders: list[Path]) -> Path:
    found = [f / "index.json" for f in folders if (f / "index.json").is_file()]
    if not found:
        raise DataError(f"no index.json in {', '.join(map(str, folders))} (made by `enhancer-train pack`)")
    return found[0]


def load(folders, verify: bool = True, threads: int | None = None, log=print) -> dict[tuple[str, str], AudioSet]:
    """Decode a packed corpus into memory: {(category, split): AudioSet}. `folders` is one folder
    or several (the shards spread over them). Checks each shard's sha256 and decoded length."""
    import soundfile as sf

    folders = [Path(f) for f in ([folders] if isinstance(folders, (str, os.PathLike)) else folders)]
    path = find_index(folders)
    with open(path, encoding="utf-8") as f:
        index = json.load(f)
    if index.get("format") != FORMAT:
        raise DataError(f"{path}: unknown format {index.get('format')!r}")
    if int(index.get("sample_rate", 0)) != SAMPLE_RATE:
        raise DataError(f"{path}: sample rate {index.get('sample_rate')} (expected {SAMPLE_RATE})")

    def locate(name: str) -> Path:
        for f in folders:
            if (f / name).is_file():
                return f / name
        raise DataError(f"shard {name} not found in {', '.join(map(str, folders))}")

    def decode(shard: dict) -> np.ndarray:
        p = locate(shard["file"])
        if verify and sha256(p) != shard["sha256"]:
            raise DataError(f"{p}: sha256 differs from the index (a damaged or partial copy)")
        y, sr = sf.read(str(p), dtype="float32")
        if sr != SAMPLE_RATE or y.ndim != 1 or len(y) != int(shard["samples"]):
            raise DataError(f"{p}: decoded {len(y)} samples at {sr} Hz, expected {shard['samples']} at {SAMPLE_RATE}")
        return y * np.float32(shard.get("gain", 1.0))

    sets = {}
    with ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
        for name, entry in index["sets"].items():
            cat, split = name.split("_", 1)
            decoded = list(pool.map(decode, entry["shards"]))
            bases = np.concatenate([[0], np.cumsum([len(y) for y in decoded])[:-1]]).astype(np.int64)
            audio = np.concatenate(decoded) if decoded else np.zeros(0, np.float32)
            items = [Item(**c["item"]) for c in entry["clips"]]
            offsets = np.array([bases[c["shard"]] + c["offset"] for c in entry["clips"]], np.int64)
            lengths = np.array([c["length"] for c in entry["clips"]], np.int64)
            sets[cat, split] = AudioSet(items, offsets, lengths, audio, [], None)
            log(f"  {name}: {len(items)} clips, {entry['seconds'] / 3600:.2f} h from {len(entry['shards'])} shard(s)")
    for cat in ("speech", "noise"):
        for split in SPLITS:
            if (cat, split) not in sets:
                raise DataError(f"{path}: no {cat}_{split} set")
    return sets


def packed_layout(folders, log=print):
    """A corpus packed by `pack`, decoded into memory, as the `TrainingData` of `fit --shards`."""
    from .layouts import TrainingData

    folders = [Path(f) for f in folders]
    sets = load(folders, log=log)
    data = TrainingData(description=f"packed corpus in {', '.join(map(str, folders))}", audio=sets)
    for (cat, split), audio in sets.items():
        (data.train if split == "train" else data.valid)[cat] = list(audio.items)
    return data.check()


def add_pack(sub) -> None:
    p = sub.add_parser("pack", help="a compact copy of the decoded corpus (compressed shards) for another machine")
    p.add_argument("--data", type=Path, required=True, help="corpus root (as for fit --data)")
    p.add_argument("--out", type=Path, required=True, help="folder for the shards and index.json")
    p.add_argument("--codec", choices=tuple(CODECS), default="opus")
    p.add_argument("--codec-for", action="append", default=[], metavar="SET=CODEC",
                   help="another codec for a set or category, e.g. speech=flac (lossless training targets)")
    p.add_argument("--quality", type=float, default=0.9, help="opus: libsndfile compression level 0..1 (0.9: ~30 kbit/s)")
    p.add_argument("--shard-mb", type=float, default=30.0, help="target size of one shard")
    p.add_argument("--max-hours", action="append", default=[], metavar="SET=HOURS",
                   help="keep a seeded random subset of a set or category, e.g. music=3.5 or music_valid=0.3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, help="16 kHz audio cache (default ~/.cache/tim-enhancer/audio)")
    p.add_argument("--jobs", type=int, help="processes decoding audio into the cache")
    p.set_defaults(func=cmd_pack)


def _assignments(pairs: list[str], flag: str, form: str, value) -> dict:
    """["speech=flac", ...] -> {"speech": value("flac"), ...}; a pair without "=" is an error."""
    out = {}
    for kv in pairs:
        k, sep, v = kv.partition("=")
        if not sep:
            raise ValueError(f"{flag} {kv!r}: expected {form}")
        out[k.strip()] = value(v)
    return out


def cmd_pack(args) -> int:
    from .layouts import corpus_layout

    hours = _assignments(args.max_hours, "--max-hours", "SET=HOURS", float)
    codec_for = _assignments(args.codec_for, "--codec-for", "SET=CODEC", str.strip)
    sets = corpus_layout(args.data).check().decoded(args.cache_dir, args.jobs)
    index = pack(sets, args.out, args.codec, args.quality, args.shard_mb, hours, args.seed, codec_for=codec_for)
    total = sum(s["bytes"] for e in index["sets"].values() for s in e["shards"])
    print(f"{args.out}: {total / 1e6:.1f} MB in {sum(len(e['shards']) for e in index['sets'].values())} shard(s)")
    return 0
