"""`enhancer bench`: latency and throughput of the step graph on this machine.

Measures, with one intra-op thread per session: the algorithmic latency; compute per 16 ms step
(p50/p99) at several batch sizes (streams stacked in one call, rings written in place as in serving),
back to back and paced at one step per hop as live streams arrive (the weights and rings then
come from colder caches, so a paced step costs more);
the real-time factor of offline `enhance` (T = `OFFLINE_FRAMES` hops per call) and of offline runs
at several T, with the best T (by CPU time: on a shared machine it is the steadier clock; with one
thread it is the compute time); how many streams one core holds in real time (the largest batch
whose p99 step time fits in one hop, found by search: doubling from the grid, then bisection); what a
live stream costs per 16 ms of audio at that batch beside what the same audio costs offline; and
the peak resident memory.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import numpy as np

from .config import SAMPLE_RATE
from .device_pool import engine_device, make_pool, uses_device_pool
from .pools import LanePoolProtocol
from .runtime import OFFLINE_FRAMES, Enhancer

BATCHES = (1, 4, 16, 32, 64)
GPU_BATCHES = (1, 16, 64, 256, 1024)  # under CUDA (`--device cuda`): one GPU holds hundreds of streams
SEARCH_LIMIT = {"cpu": 1024, "cuda": 8192}  # the largest batch the real-time search tries
PACED_BATCHES = (1, 16)
OFFLINE_SWEEP = (1, 16, 32, 64, 128, 256)  # frames per call of the offline runs
# Share of the measured real-time capacity to plan for: an upper bound, to verify with a soak
# (server/README.md) on the machine that serves.
HEADROOM = 2 / 3


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def time_steps(enh: Enhancer, batch: int, steps: int, warmup: int = 20, seed: int = 0, pace_s: float = 0.0,
               full_steps: bool = False, device_pool: bool = False) -> np.ndarray:
    """Milliseconds per `LanePool.step` of `batch` streams, after `warmup` steps. With `pace_s`, one
    step starts every `pace_s` seconds, as for live streams (caches cool down between steps). The
    pool is the one the service uses for this engine (`make_pool` with `full_steps` and
    `device_pool`: under CUDA the caches stay on the GPU), so a step's time includes what crosses
    the bus."""
    pool: LanePoolProtocol = make_pool(enh.engine, batch, full_steps=full_steps, device_pool=device_pool)
    lanes = pool.alloc(batch)
    rng = np.random.default_rng(seed)
    hop = enh.config.stft.hop
    audio = (rng.standard_normal((warmup + steps, batch, hop)) * 0.05).astype(np.float32)
    gain = np.zeros(batch, np.float32)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        pool.step(lanes, audio[i], gain)
        times.append(time.perf_counter() - t0)
        if pace_s:
            time.sleep(max(0.0, pace_s - (time.perf_counter() - t0)))
    return np.array(times[warmup:]) * 1000.0


def realtime_batch_search(budget_ms: float, start: int = 1, limit: int = 1024):
    """The search of `largest_realtime_batch` as a generator: it yields each batch to time, is sent
    that batch's p99 step time in ms, and returns (batch, {batch: p99 ms of every batch timed}), so
    that the searches of several models can take turns (`run_many`)."""
    seen: dict[int, float] = {start: float((yield start))}
    good, bad = (start, None) if seen[start] <= budget_ms else (0, start)
    while bad is None and good < limit:
        b = min(2 * good, limit)
        if b not in seen:
            seen[b] = float((yield b))
        good, bad = (b, None) if seen[b] <= budget_ms else (good, b)
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        if mid not in seen:
            seen[mid] = float((yield mid))
        good, bad = (mid, bad) if seen[mid] <= budget_ms else (good, mid)
    return good, seen


def largest_realtime_batch(p99_ms, budget_ms: float, start: int = 1, limit: int = 1024) -> tuple[int, dict[int, float]]:
    """The largest batch b <= `limit` with `p99_ms(b) <= budget_ms` (0 if none), by doubling from
    `start` until a batch is over the budget, then bisecting between the last batch within it and
    the first over it (between 0 and `start` when `start` itself is over). The step time grows with
    the batch, so the first crossing is the answer. Returns (batch, {batch: p99 ms of every batch timed})."""
    search = realtime_batch_search(budget_ms, start, limit)
    try:
        b = next(search)
        while True:
            b = search.send(p99_ms(b))
    except StopIteration as done:
        return done.value


def stage_steps(steps: int, share: int) -> int:
    """Steps of a paced or search stage: a `share`-th of `steps`, at least 60; all of them below 60
    (a quick, rough run)."""
    return steps if steps < 60 else max(60, steps // share)


def time_offline(enh: Enhancer, x: np.ndarray, frames: int) -> tuple[float, float]:
    """Real-time factor of one 16 kHz mono signal run through a stream in calls of `frames` hops:
    (wall clock, CPU time of this process)."""
    s = enh.stream()
    s.frames_per_call = frames
    t0, c0 = time.perf_counter(), time.process_time()
    s.feed(x)
    s.flush()
    seconds = len(x) / enh.config.stft.sample_rate
    return (time.perf_counter() - t0) / seconds, (time.process_time() - c0) / seconds


def run(enh: Enhancer, steps: int = 300, batches=BATCHES, seconds: float = 20.0, progress: bool = False,
        **pool) -> dict:
    """The measurements of one model (see the module docstring). `progress`: a bar on stderr;
    `pool`: `make_pool`'s switches (full_steps, device_pool)."""
    return run_many([enh], steps=steps, batches=batches, seconds=seconds, progress=progress, **pool)[0]


def default_batches(enh: Enhancer) -> tuple[int, ...]:
    """The batch sizes timed by default: `GPU_BATCHES` under CUDA, else `BATCHES`."""
    return GPU_BATCHES if engine_device(enh.engine) == "cuda" else BATCHES


def run_many(enhs: list[Enhancer], steps: int = 300, batches=None, seconds: float = 20.0,
             progress: bool = False, full_steps: bool = False, device_pool: bool = False) -> list[dict]:
    """The measurements of several models on this machine, interleaved: every stage (a batch size,
    the paced steps, each offline size) times each model in turn before the next stage, so that a
    change in the machine's load between stages weighs on all of them alike; the searches of the
    largest real-time batch take turns too, one batch of each model's search at a time. `progress`:
    a bar on stderr, one tick per stage. `full_steps`, `device_pool`: the step pools' switches
    (`make_pool`)."""
    from tqdm import tqdm

    cfg = enhs[0].config
    n = len(enhs)
    batches = tuple(batches or default_batches(enhs[0]))
    bar = tqdm(total=n * (len(batches) + len(PACED_BATCHES) + 2), desc="bench", unit="stage", disable=not progress,
               file=sys.stderr)
    hop_ms = 1000.0 * cfg.stft.hop / cfg.stft.sample_rate
    pool = {"full_steps": full_steps, "device_pool": device_pool}
    results = [_header(enh) | {"stream_state": "device" if uses_device_pool(enh.engine, device_pool) else "host",
                               "full_steps": full_steps} for enh in enhs]
    for b in batches:
        for enh, res in zip(enhs, results):
            bar.set_postfix_str(f"{b} stream(s) back to back")
            ms = time_steps(enh, b, steps if b <= 16 else max(60, steps // 4), **pool)
            bar.update()
            res["step"].append({
                "batch": b, "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
                "per_stream_p50_ms": float(np.percentile(ms, 50) / b),
                "realtime": bool(np.percentile(ms, 99) <= hop_ms),
            })
    for b in PACED_BATCHES:
        for enh, res in zip(enhs, results):
            bar.set_postfix_str(f"{b} stream(s) paced")
            ms = time_steps(enh, b, stage_steps(steps, 2), pace_s=hop_ms / 1000.0, **pool)
            bar.update()
            res["paced"].append({"batch": b, "p50_ms": float(np.percentile(ms, 50)),
                                 "p99_ms": float(np.percentile(ms, 99))})
    search_steps = stage_steps(steps, 4)
    bar.set_postfix_str("searching the largest real-time batch")
    searches = {}  # model index -> (its search, the batch it asks for next); the models take turns
    for i, res in enumerate(results):
        ok = [s["batch"] for s in res["step"] if s["realtime"]]
        search = realtime_batch_search(hop_ms, start=max(ok) if ok else 1, limit=SEARCH_LIMIT[res["device"]])
        searches[i] = (search, next(search))
    while searches:
        for i in list(searches):
            search, b = searches[i]
            try:
                searches[i] = (search, search.send(np.percentile(time_steps(enhs[i], b, search_steps, **pool), 99)))
            except StopIteration as done:
                best_b, timed = done.value
                results[i]["streams_per_core"] = best_b
                results[i]["search"] = [{"batch": b, "p99_ms": ms} for b, ms in sorted(timed.items())]
                del searches[i]
                bar.update()
    cores = usable_cores()
    for enh, res in zip(enhs, results):
        if res["streams_per_core"]:
            ms = time_steps(enh, res["streams_per_core"], search_steps, **pool)
            res["live_cost_ms_per_hop"] = float(np.percentile(ms, 50) / res["streams_per_core"])  # one stream's share
        best = min(res["step"], key=lambda s: s["per_stream_p50_ms"])
        res["streams_per_core_throughput"] = float(hop_ms / best["per_stream_p50_ms"])
        gpu = res["device"] == "cuda"
        if gpu:
            res["streams_per_gpu"] = res["streams_per_core"]  # the same search: one GPU, not one core
        res["cores"] = cores
        res["suggested_workers"] = 1 if gpu else cores  # one worker drives the GPU
        # on a GPU the step is not what bounds one service process (format_table says what to do)
        res["suggested_max_streams"] = None if gpu else int(HEADROOM * res["streams_per_core"] * cores)
    x = (np.random.default_rng(1).standard_normal(int(seconds * SAMPLE_RATE)) * 0.05).astype(np.float32)
    bar.set_postfix_str(f"offline enhance of {seconds:g} s, then T = {', '.join(map(str, OFFLINE_SWEEP))}")
    for enh in enhs:
        enh.enhance(x[:SAMPLE_RATE], SAMPLE_RATE)  # warm up the multi-frame shapes
    for enh, res in zip(enhs, results):
        t0, c0 = time.perf_counter(), time.process_time()
        enh.enhance(x, SAMPLE_RATE)
        res["offline_rtf"] = (time.perf_counter() - t0) / seconds
        res["offline_rtf_cpu"] = (time.process_time() - c0) / seconds
        res["offline_frames"] = OFFLINE_FRAMES
        res["offline"] = []
    for t in OFFLINE_SWEEP:
        for enh, res in zip(enhs, results):
            wall, cpu = time_offline(enh, x[: int(min(seconds, 4.0 if t == 1 else seconds) * SAMPLE_RATE)], t)
            res["offline"].append({"frames": t, "rtf": wall, "rtf_cpu": cpu})
    for res in results:
        res["offline_best_frames"] = min(res["offline"], key=lambda r: r["rtf_cpu"])["frames"]
        res["offline_cost_ms_per_hop"] = res["offline_rtf_cpu"] * hop_ms  # the same 16 ms of audio, run offline
        if "live_cost_ms_per_hop" in res:
            res["live_over_offline"] = res["live_cost_ms_per_hop"] / res["offline_cost_ms_per_hop"]
        bar.update()
    bar.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    for res in results:
        res["peak_rss_mb"] = peak  # of the whole run (every model loaded)
    return results


def _header(enh: Enhancer) -> dict:
    cfg = enh.config
    return {
        "model": str(enh.engine.path), "preset": cfg.name, "parameters": enh.engine.parameters,
        "provider": enh.provider, "device": engine_device(enh.engine), "weights": enh.engine.weights, "rings": enh.engine.ring_format,
        "algorithmic_latency_ms": cfg.algorithmic_latency_ms,
        "stream_delay_ms": 1000.0 * cfg.delay_samples / cfg.stft.sample_rate, "window_frames": cfg.attention_window,
        "step": [], "paced": [],
    }


def format_table(res: dict) -> str:
    gpu = res.get("device") == "cuda"
    unit = "GPU" if gpu else "core"
    if gpu:
        capacity = (f"capacity         one GPU steps {res['streams_per_core']} streams; one service process feeds far "
                    "fewer (its event loop and worker share one interpreter): run `enhancer step-server --device cuda` "
                    "with several `enhancer serve --step-server` front-ends, and size them with the load test "
                    "(server/README.md, Serving on a GPU)")
    else:
        capacity = (f"capacity         {res['cores']} core(s) here: try `enhancer serve --workers {res['suggested_workers']} "
                    f"--max-streams {res['suggested_max_streams']}` ({HEADROOM:.0%} of {res['streams_per_core']} x "
                    f"{res['cores']}), then confirm with a soak (server/README.md)")
    lines = [
        f"model            {res['model']} ({res['preset']}, {res['parameters']:,} parameters, {res['weights']} weights, "
        f"{res['rings']} key/value rings, {res['provider']})",
        f"latency          {res['algorithmic_latency_ms']:.0f} ms algorithmic (window + lookahead); "
        f"output stream delay {res['stream_delay_ms']:.0f} ms",
        "",
        "batch   p50 ms/step   p99 ms/step   ms/stream (p50)   real time (p99 <= 16 ms)",
    ]
    for s in res["step"]:
        lines.append(f"{s['batch']:>5}   {s['p50_ms']:>11.2f}   {s['p99_ms']:>11.2f}   {s['per_stream_p50_ms']:>15.3f}   "
                     f"{'yes' if s['realtime'] else 'no'}")
    lines.append("paced   " + "; ".join(f"batch {s['batch']}: p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms"
                                          for s in res["paced"]) + " (one step per hop, as live streams)")
    lines += [
        "",
        f"streams per {unit:<4} {res['streams_per_core']} (the largest batch whose p99 fits the 16 ms hop, by search: "
        + ", ".join(f"{s['batch']}: {s['p99_ms']:.1f}" for s in res["search"]) + " ms p99); "
        f"{res['streams_per_core_throughput']:.1f} by best per-stream throughput",
        f"cost per stream  {res.get('live_cost_ms_per_hop', float('nan')):.3f} ms live (at that batch) vs "
        f"{res['offline_cost_ms_per_hop']:.3f} ms offline per 16 ms of audio "
        f"({res.get('live_over_offline', float('nan')):.1f}x)",
        capacity,
        f"offline enhance  real-time factor {res['offline_rtf']:.3f} wall, {res['offline_rtf_cpu']:.3f} CPU "
        f"(1 thread, {res['offline_frames']} frames per call)",
        "offline by T     " + "; ".join(f"T={r['frames']}: {r['rtf']:.3f} / {r['rtf_cpu']:.3f}" for r in res["offline"])
        + f" (wall / CPU); best T = {res['offline_best_frames']}",
        f"peak memory      {res['peak_rss_mb']:.0f} MB RSS",
    ]
    return "\n".join(lines)


def format_comparison(results: list[dict]) -> str:
    """One row per model: streams per core, step p50 / p99 per batch size, live and offline cost."""
    batches = [s["batch"] for s in results[0]["step"]]
    lines = ["model   streams/core   " + "   ".join(f"batch {b:>3} p50/p99 ms" for b in batches)
             + "   live / offline ms per stream-hop   offline RTF (CPU)"]
    for i, res in enumerate(results, 1):
        steps = "   ".join(f"{s['p50_ms']:>9.2f} / {s['p99_ms']:<6.2f}" for s in res["step"])
        lines.append(f"{i:>5}   {res['streams_per_core']:>12}   {steps}   "
                     f"{res.get('live_cost_ms_per_hop', float('nan')):>15.3f} / {res['offline_cost_ms_per_hop']:<15.3f}"
                     f"   {res['offline_rtf_cpu']:.4f}")
    lines += [f"{i:>5}   {res['model']}" for i, res in enumerate(results, 1)]
    return "\n".join(lines)


def main(enhs: Enhancer | list[Enhancer], as_json: bool = False, steps: int = 300, progress: bool = True,
         batches=None, full_steps: bool = False, device_pool: bool = False, seconds: float = 20.0) -> int:
    """`enhancer bench`: one model, or several measured in the same run, interleaved (`run_many`),
    stepped in the pools `make_pool(..., full_steps=full_steps, device_pool=device_pool)` gives."""
    enhs = enhs if isinstance(enhs, list) else [enhs]
    if progress:
        names = ", ".join(str(e.engine.path) for e in enhs)
        print(f"timing the step graph of {names} on this machine ({enhs[0].provider}, one intra-op thread)",
              file=sys.stderr, flush=True)
    results = run_many(enhs, steps=steps, batches=batches, seconds=seconds, progress=progress, full_steps=full_steps,
                       device_pool=device_pool)
    if as_json:
        sys.stdout.write(json.dumps(results[0] if len(results) == 1 else results, indent=2) + "\n")
    else:
        tables = [format_table(r) for r in results]
        if len(results) > 1:
            tables.append("measured in the same run, interleaved:\n" + format_comparison(results))
        sys.stdout.write("\n\n".join(tables) + "\n")
    return 0
