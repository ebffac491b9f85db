"""Run peers over file pairs: enhance, time, score; one crash never stops the benchmark.

Each peer runs in a process of its own (spawned, one CPU thread), so a peer that pins other
library versions in memory, leaks threads or dies in native code cannot touch the others. Files
go to the process one at a time: a Python error on a file is recorded in that file's row; a
process that dies is recorded on the file it was working on, and a fresh process takes the next.
"""
from __future__ import annotations

import math
import multiprocessing
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from enhancer.config import SAMPLE_RATE

from .adapters import make_peer, single_thread
from .align import as_mono
from .pairs import Pair
from .score import ALL_METRICS, score

WARMUP_SECONDS = 1.0


@dataclass(frozen=True)
class PeerSpec:
    """What a worker process needs to build a peer."""

    name: str
    model: str | None = None  # tim-enhancer only
    label: str | None = None  # tim-enhancer only
    dnsmos: str | None = None  # DNSMOS model folder: score SIG / BAK / OVRL too


# ---------------------------------------------------------------------- in the worker
_loaded: dict = {}
_judges: dict = {}


def _judge(folder: str | None):
    """The worker's DNSMOS for `folder` (one per process), or None."""
    if folder is None:
        return None
    if folder not in _judges:
        from ..evaluation.dnsmos import DNSMOS

        _judges[folder] = DNSMOS(folder)
    return _judges[folder]



def _peer(spec: PeerSpec):
    """The worker's peer, built and warmed up on first use. Returns (peer, load_seconds)."""
    if spec not in _loaded:
        single_thread()
        peer = make_peer(spec.name, spec.model, spec.label)
        t0 = time.perf_counter()
        peer.ensure_loaded()
        warm = (0.01 * np.random.default_rng(0).standard_normal(int(WARMUP_SECONDS * SAMPLE_RATE))).astype(np.float32)
        peer.enhance(warm, SAMPLE_RATE)
        _loaded[spec] = (peer, time.perf_counter() - t0)
    return _loaded[spec]


def _blank(spec: PeerSpec) -> dict:
    """Metadata of a peer that could not even be built."""
    return {"name": spec.label or spec.name, "package": "", "version": "", "rate": 0, "delay_samples": 0,
            "settings": "", "load_seconds": math.nan}


def describe(spec: PeerSpec) -> dict:
    """Peer metadata; `status` "ok" after a successful load, else "unavailable" or "failed"."""
    try:
        peer = make_peer(spec.name, spec.model, spec.label)
    except Exception as e:  # any peer failure is reported, not raised
        return {**_blank(spec), "status": "failed", "reason": f"{type(e).__name__}: {e}"}
    info = {"name": peer.name, "package": peer.package, "version": peer.version(), "rate": peer.rate,
            "delay_samples": getattr(peer, "delay", 0), "settings": peer.settings,
            "status": "ok", "reason": "", "load_seconds": math.nan}
    reason = peer.missing()
    if reason:
        return {**info, "status": "unavailable", "reason": reason}
    try:
        info["load_seconds"] = _peer(spec)[1]
    except Exception as e:
        return {**info, "status": "failed", "reason": f"load: {type(e).__name__}: {e}"}
    return info


def read_mono(path: str) -> tuple[np.ndarray, int]:
    audio, sr = sf.read(path, dtype="float32", always_2d=True)
    return as_mono(audio), int(sr)


def run_file(spec: PeerSpec, pair: Pair, save_dir: str | None = None) -> dict:
    """One row: the pair's metrics for this peer, timing, or the error."""
    row = {"peer": "", "file": pair.id, "snr": pair.snr, "seconds": math.nan, "enhance_seconds": math.nan,
           **dict.fromkeys(ALL_METRICS, math.nan), "error": ""}
    try:
        peer, _ = _peer(spec)
        row["peer"] = peer.name
        noisy, sr = read_mono(pair.noisy)
        clean, sr_c = read_mono(pair.clean)
        if sr != sr_c:
            raise ValueError(f"noisy is {sr} Hz, clean {sr_c} Hz")
        if len(noisy) != len(clean):
            raise ValueError(f"noisy has {len(noisy)} samples, clean {len(clean)}")
        row["seconds"] = len(noisy) / sr
        t0 = time.perf_counter()
        out = peer.enhance(noisy, sr)
        row["enhance_seconds"] = time.perf_counter() - t0
        if out.shape != noisy.shape:
            raise ValueError(f"output shape {out.shape} != input shape {noisy.shape}")
        if not np.isfinite(out).all():
            raise ValueError("output has NaN or Inf samples")
        row.update(score(out, clean, sr, _judge(spec.dnsmos)))
        if save_dir:
            dest = Path(save_dir) / peer.name / pair.id
            dest.parent.mkdir(parents=True, exist_ok=True)
            sf.write(dest.with_suffix(".wav"), out, sr, subtype="FLOAT")
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}".strip()
        row["traceback"] = traceback.format_exc(limit=4)
    return row


# ---------------------------------------------------------------------- in the parent
def run_peer(spec: PeerSpec, pairs: list[Pair], save_dir=None, isolate: bool = True, log=None) -> dict:
    """Metadata plus one row per pair for one peer."""
    if not isolate:
        info = describe(spec)
        rows = [run_file(spec, p, save_dir) for p in pairs] if info["status"] == "ok" else []
        return _finish(info, rows, log)
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(1, mp_context=ctx)
    try:
        try:
            info = pool.submit(describe, spec).result()
        except BrokenProcessPool:
            info = {**_blank(spec), "status": "failed", "reason": "load: the peer's process died"}
        rows = []
        for p in pairs if info["status"] == "ok" else []:
            try:
                rows.append(pool.submit(run_file, spec, p, None if save_dir is None else str(save_dir)).result())
            except BrokenProcessPool:
                rows.append({"peer": info["name"], "file": p.id, "snr": p.snr, "error": "the peer's process died on this file"})
                pool.shutdown(wait=False, cancel_futures=True)
                pool = ProcessPoolExecutor(1, mp_context=ctx)
        return _finish(info, rows, log)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _finish(info: dict, rows: list[dict], log) -> dict:
    for r in rows:
        r["peer"] = info["name"]
    result = {**info, "rows": rows}
    if log:
        if info["status"] != "ok":
            log(f"{info['name']}: {info['status']}: {info['reason']}")
        else:
            ok = [r for r in rows if not r.get("error")]
            pesq = np.nanmean([r["pesq_wb"] for r in ok]) if ok else math.nan
            log(f"{info['name']}: {len(ok)}/{len(rows)} files, PESQ-WB {pesq:.3f}")
    return result


def run_benchmark(pairs: list[Pair], specs: list[PeerSpec], jobs: int = 1, save_dir=None,
                  isolate: bool = True, log=None) -> list[dict]:
    """Every peer over every pair, `jobs` peers at a time; results in the order of `specs`."""
    if not isolate or jobs <= 1:
        return [run_peer(s, pairs, save_dir, isolate, log) for s in specs]
    with ThreadPoolExecutor(jobs) as ex:
        return list(ex.map(lambda s: run_peer(s, pairs, save_dir, True, log), specs))
