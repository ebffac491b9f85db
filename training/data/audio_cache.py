"""Decode and resample audio once: a 16 kHz mono float32 cache per manifest.

A cache is a folder `<cache_root>/<name>-<key>/` with `audio.f32` (every kept file, back to back)
and `index.json` (offset and length of each kept file, plus the files that could not be read and
why). The key hashes the file list, sizes and modification times, so a changed manifest or file
builds a new cache. Building happens once, under a file lock (several ranks or runs may share a
cache), into a temporary folder renamed into place when complete. Reading is a read-only memmap.

Unreadable, empty, silent or non-finite files are skipped, reported with their path and counted.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from enhancer.config import SAMPLE_RATE

from .manifests import DataError, Item

FORMAT = "tim-enhancer-audio-cache/1"


def default_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tim-enhancer" / "audio"


class AudioReadError(Exception):
    pass


def load_audio(path, sample_rate: int = SAMPLE_RATE, quality: str = "HQ") -> np.ndarray:
    """Read any libsndfile format, average the channels, resample to `sample_rate`. float32 (n,)."""
    import soundfile as sf
    import soxr

    if not Path(path).is_file():
        raise AudioReadError(f"file not found: {path}")
    try:
        x, sr = sf.read(str(path), dtype="float32", always_2d=True)  # (n, channels)
    except Exception as e:  # libsndfile raises several types for bad files
        raise AudioReadError(f"cannot decode ({type(e).__name__}: {e})") from None
    if x.size == 0:
        raise AudioReadError("no samples")
    x = x.mean(axis=1)  # (n,)
    if not np.isfinite(x).all():
        raise AudioReadError("NaN or Inf samples")
    if sr != sample_rate:
        x = soxr.resample(x, sr, sample_rate, quality=quality).astype(np.float32)
    if not np.any(np.abs(x) > 1e-6):
        raise AudioReadError("digital silence")
    return np.ascontiguousarray(x, dtype=np.float32)


def read16k(path) -> np.ndarray:
    """One file for scoring (eval, dev set, plots, competition): 16 kHz mono float32, the best
    resampling; a file that cannot be read is a DataError naming it."""
    try:
        return load_audio(path, SAMPLE_RATE, quality="VHQ")
    except AudioReadError as e:
        raise DataError(f"{path}: {e}") from None


def _load_job(path: str):
    try:
        return load_audio(path), None
    except AudioReadError as e:
        return None, str(e)
    except Exception as e:  # a worker must report, never die
        return None, f"{type(e).__name__}: {e}"


@dataclass
class AudioSet:
    """Cached audio of one manifest: `clip(i)` is the 16 kHz waveform of `items[i]`."""

    items: list[Item]
    offsets: np.ndarray  # (n,) int64
    lengths: np.ndarray  # (n,) int64
    audio: np.ndarray  # (total,) float32 memmap
    skipped: list[dict]
    folder: Path | None = None

    def __len__(self) -> int:
        return len(self.items)

    def clip(self, i: int) -> np.ndarray:
        o = int(self.offsets[i])
        return self.audio[o:o + int(self.lengths[i])]

    @property
    def seconds(self) -> float:
        return float(self.lengths.sum()) / SAMPLE_RATE

    @classmethod
    def from_arrays(cls, items: list[Item], clips: list[np.ndarray]) -> AudioSet:
        """An in-memory set (tests, small folders)."""
        lengths = np.array([len(c) for c in clips], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        audio = np.concatenate(clips).astype(np.float32) if clips else np.zeros(0, np.float32)
        return cls(list(items), offsets, lengths, audio, [])


def cache_key(items: list[Item]) -> str:
    h = hashlib.sha1(f"{FORMAT} {SAMPLE_RATE}".encode())
    for it in items:
        try:
            st = os.stat(it.path)
            stamp = f"{st.st_size} {st.st_mtime_ns}"
        except OSError:
            stamp = "missing"
        h.update(json.dumps([it.path, stamp, it.group, it.bandwidth_hz]).encode())
    return h.hexdigest()[:16]


def cached_audio(items: list[Item], name: str, cache_root=None, jobs: int | None = None, log=print) -> AudioSet:
    """The cache of `items`, built if needed. Raises `DataError` if no file is readable."""
    if not items:
        raise DataError(f"{name}: no files")
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    folder = root / f"{name}-{cache_key(items)}"
    with open(root / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait and then read
        if not (folder / "index.json").is_file():
            _build(items, folder, name, jobs, log)
    s = open_cache(folder)
    if s.skipped:
        log(f"{name}: skipped {len(s.skipped)} unreadable file(s) of {len(items)}:")
        for bad in s.skipped[:20]:
            log(f"  {bad['error']}" if bad["path"] in bad["error"] else f"  {bad['path']}: {bad['error']}")
        if len(s.skipped) > 20:
            log(f"  ... and {len(s.skipped) - 20} more (see {folder / 'index.json'})")
    if not len(s):
        raise DataError(f"{name}: none of the {len(items)} files could be read")
    return s


def open_cache(folder) -> AudioSet:
    folder = Path(folder)
    with open(folder / "index.json", encoding="utf-8") as f:
        index = json.load(f)
    if index.get("format") != FORMAT:
        raise DataError(f"{folder}: unknown cache format {index.get('format')!r}; delete the folder to rebuild")
    items = [Item(**d) for d in index["items"]]
    n = int(index["total_samples"])
    audio = np.memmap(folder / "audio.f32", dtype=np.float32, mode="r", shape=(n,)) if n else np.zeros(0, np.float32)
    return AudioSet(items, np.array(index["offsets"], np.int64), np.array(index["lengths"], np.int64), audio,
                    index["skipped"], folder)


def _build(items: list[Item], folder: Path, name: str, jobs: int | None, log) -> None:
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    jobs = jobs or max(1, os.cpu_count() or 1)
    kept, offsets, lengths, skipped = [], [], [], []
    log(f"{name}: decoding {len(items)} files to 16 kHz in {folder} ({jobs} process(es))")
    paths = [it.path for it in items]
    pool = ProcessPoolExecutor(jobs) if jobs > 1 else None
    try:
        results = pool.map(_load_job, paths, chunksize=8) if pool else map(_load_job, paths)
        _write(items, results, tmp, name, log, kept, offsets, lengths, skipped)
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    total = int(sum(lengths))
    index = {
        "format": FORMAT, "sample_rate": SAMPLE_RATE, "total_samples": total,
        "items": [asdict(it) for it in kept], "offsets": offsets, "lengths": lengths, "skipped": skipped,
    }
    with open(tmp / "index.json", "w", encoding="utf-8") as f:
        json.dump(index, f)
    os.replace(tmp, folder)


def _write(items, results, tmp: Path, name: str, log, kept, offsets, lengths, skipped) -> None:
    total, t0, last = 0, time.time(), 0.0
    with open(tmp / "audio.f32", "wb") as out:
        for i, (it, (x, err)) in enumerate(zip(items, results)):
            if x is None:
                skipped.append({"path": it.path, "error": err})
            else:
                out.write(x.tobytes())
                kept.append(it)
                offsets.append(total)
                lengths.append(len(x))
                total += len(x)
            now = time.time()
            if now - last > 30 or i + 1 == len(items):
                last = now
                log(f"{name}: {i + 1}/{len(items)} files, {total / SAMPLE_RATE / 60:.1f} min, {now - t0:.0f} s")


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
