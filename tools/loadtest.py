"""Load benchmark: N websocket clients stream a real file at real-time pace for T seconds.

    python -m tools.loadtest --streams 32 --seconds 30            # starts a local server
    python -m tools.loadtest --streams 32 --url ws://127.0.0.1:8000/v1/stream --server-pid PID
    python -m tools.loadtest --overload 2 --seconds 60                # 2x the measured capacity

Each client sends `--chunk-ms` of audio every `--chunk-ms` (start times spread over one chunk
period, as independent clients are) and reads the enhanced audio back. Output is sample-aligned
with the input, so the enhanced version of input sample p is output sample p; for every output
message the latency of its first (oldest) sample is `arrival time - time the chunk holding that
sample was sent`. A message is late when that latency exceeds the budget: by default
algorithmic latency + one chunk + 64 ms for processing, queueing and the resamplers.
Reports late messages, latency p50/p99/max, server CPU (% of one core) and peak memory.

Overload mode (`--overload FACTOR`): the server measures its capacity at start-up (a server
started here calibrates; one at --url reports it in /readyz), and FACTOR x capacity clients
connect at once. Reported: admitted, refused (close 1013 with the JSON error naming the capacity),
late messages of the admitted streams (apart from machine and load generator stalls), latency,
the server's late notices and skipped backlogs, and whether /healthz and /readyz still answer.

With no --model and no shipped models/tim.onnx, a random-weight `tim` preset (default window) is
exported once to artifacts/loadtest/ (needs torch in this environment; the server stays torch-free):
speed does not depend on the weights.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from enhancer.resample import round_trip_ms
from server.stalls import freeze_startup_objects

from . import REPO_ROOT
from .loadtest_clients import LagProbe, run_observed
from .machine_stalls import STALL_S, MachineStallObserver, stall_explains

LOOP_LAG_UNDER_STALL = f'tim_event_loop_lag_seconds_bucket{{le="{STALL_S}"}}'  # server loop wake-ups that were no stall

DEFAULT_FILES = sorted((REPO_ROOT.parent / "shared" / "data" / "dev" / "valentini_p287" / "noisy").glob("*.wav"))
RANDOM_MODEL = REPO_ROOT / "artifacts" / "loadtest" / "tim-random.onnx"


# ---------------------------------------------------------------------------------- set-up
def model_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from enhancer.runtime import default_model_path

    shipped = default_model_path()
    if shipped.is_file():
        return shipped
    if not RANDOM_MODEL.is_file():
        print(f"exporting a random-weight tim preset to {RANDOM_MODEL} ...", flush=True)
        RANDOM_MODEL.parent.mkdir(parents=True, exist_ok=True)
        code = ("import torch, enhancer; from enhancer.build.export import export_step; torch.manual_seed(0); "
                "m = enhancer.build_model(enhancer.ModelConfig.preset('tim')).eval(); "
                f"export_step(m, {str(RANDOM_MODEL)!r}, check=False)")
        subprocess.run([sys.executable, "-c", code], check=True)
    return RANDOM_MODEL


def load_audio(path: str | None, rate: int | None) -> tuple[np.ndarray, int]:
    """Mono int16 audio to stream (the file's rate, or resampled to `rate`)."""
    import soundfile as sf

    from enhancer.signal import resample

    if path is None and not DEFAULT_FILES:
        raise SystemExit("no --file given and no default data set found")
    files = [Path(path)] if path else DEFAULT_FILES
    parts, sr = [], None
    for f in files:
        x, r = sf.read(str(f), dtype="float32", always_2d=True)
        x = x.mean(axis=1)
        sr = sr or r
        parts.append(resample(x, r, sr) if r != sr else x)
    x = np.concatenate(parts)
    if rate and rate != sr:
        x, sr = resample(x, sr, rate), rate
    return np.clip(np.round(x * 32768), -32768, 32767).astype("<i2"), sr


def default_budget_ms(ready: dict, rate: int, chunk_ms: float) -> float:
    """The late threshold: the stream's algorithmic latency at `rate` (the model's, from /readyz, and
    the resamplers' to the model's rate and back), a chunk and 64 ms."""
    return ready["latency_ms"] + round_trip_ms(rate, int(ready.get("sample_rate", rate))) + chunk_ms + 64.0


def start_server(model: Path, streams: int, workers: int, threads: int, calibrate: bool = False):
    """A server process on a free loopback port: (launch.ServerProcess, websocket URL). It admits
    `streams` (a fixed capacity: the benchmark measures what the machine does with that many), or
    with `calibrate` what it measures itself (up to the default max_streams)."""
    from .launch import start

    if calibrate:
        srv = start(model, device="cpu", workers=workers, threads=threads)
    else:
        n = max(streams, 1)
        srv = start(model, device="cpu", workers=workers, max_streams=n, capacity=n, threads=threads)
    return srv, srv.ws_url


# ---------------------------------------------------------------------------------- process stats
def machine_busy_seconds() -> float:
    """CPU seconds all processes of the machine have used (user + nice + system + irq), from /proc/stat."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class ProcStats:
    """CPU time and resident memory of a process, from /proc."""

    def __init__(self, pid: int | None):
        self.pid = pid
        self.tick = os.sysconf("SC_CLK_TCK")
        self.peak_rss = 0

    def cpu_seconds(self) -> float:
        if self.pid is None:
            return float("nan")
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self.tick

    def rss_mb(self) -> float:
        if self.pid is None:
            return float("nan")
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                mb = int(line.split()[1]) / 1024
                self.peak_rss = max(self.peak_rss, mb)
                return mb
        return float("nan")


# ---------------------------------------------------------------------------------- measuring (clients: loadtest_clients)
async def sample_stats(stats: ProcStats, stop: asyncio.Event, interval: float = 0.5) -> None:
    while not stop.is_set():
        stats.rss_mb()
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


def metrics_lines(url: str, timeout: float = 10.0) -> list[str]:
    """The Prometheus text of the server behind the websocket `url`, line by line."""
    import httpx

    base = url.replace("ws", "http", 1).rsplit("/v1/", 1)[0]
    return httpx.get(base + "/metrics", timeout=timeout).text.splitlines()


def scrape(url: str) -> dict[str, float]:
    """The server's step and batch counters (sums and counts) from /metrics."""
    values = {}
    for line in metrics_lines(url, timeout=5):
        name = line.split(" ")[0]
        if name in ("tim_step_seconds_sum", "tim_step_seconds_count", "tim_batch_size_sum", "tim_batch_size_count",
                    "tim_skipped_hops_total", "tim_late_hops_total", "tim_streams_behind_total",
                    'tim_refused_total{source="stream"}',
                    "tim_event_loop_lag_seconds_count", LOOP_LAG_UNDER_STALL,
                    'tim_gc_pause_seconds_count{generation="2"}', 'tim_gc_pause_seconds_sum{generation="2"}'):
            values[name] = float(line.split()[-1])
    return values


def late_attribution(clients, budget_ms: float, observer: MachineStallObserver, probe: LagProbe | None = None) -> dict:
    """Late messages that arrived during or just after a stall of the whole machine (seen by an
    idle observer process); of the others, those that arrived during or just after a stall of the
    load generator itself (it shares the two cores with the server, so it reads a message late
    although the server sent it in time); and the rest: the ones the service is answerable for."""
    clients = [c for c in clients if getattr(c, "refused", None) is None]  # refused streams sent nothing
    late_at = [a for c in clients for a, lat in zip(c.arrivals, c.latencies) if lat * 1000 > budget_ms]
    machine = [observer.explains(a) for a in late_at]
    client = [not m and probe is not None and stall_explains(probe.events, a) for a, m in zip(late_at, machine)]
    big = [lag for _, lag in observer.events if lag > STALL_S]
    return {"machine_stalls": len(big), "machine_stall_max_ms": round(1000 * max(big), 1) if big else 0.0,
            "late_in_machine_stalls": sum(machine), "late_in_client_stalls": sum(client),
            "late_other": len(late_at) - sum(machine) - sum(client)}


def stall_figures(d: dict[str, float], probe: LagProbe) -> dict:
    """Server loop stalls (> 32 ms), server full collections, and the load generator's own stalls,
    from scrape() differences and the client's probe."""
    lag_n = d.get("tim_event_loop_lag_seconds_count", 0.0)
    return {
        "server_loop_stalls": int(lag_n - d.get(LOOP_LAG_UNDER_STALL, lag_n)),
        "server_full_gcs": int(d.get('tim_gc_pause_seconds_count{generation="2"}', 0.0)),
        "server_full_gc_ms": round(1000 * d.get('tim_gc_pause_seconds_sum{generation="2"}', 0.0), 1),
        "client_loop_stalls": probe.stalls(STALL_S),
        "client_loop_max_lag_ms": round(1000 * probe.max_lag, 1),
    }


async def measure(url: str, audio, rate, args, server_pid) -> dict:
    stats = ProcStats(server_pid)
    me = ProcStats(os.getpid())
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_stats(stats, stop))
    m0 = await asyncio.to_thread(scrape, url)
    cpu0, my0, all0, t0 = stats.cpu_seconds(), me.cpu_seconds(), machine_busy_seconds(), time.perf_counter()
    clients, probe, observer = await run_observed(url, audio, rate, args)
    wall = time.perf_counter() - t0
    cpu1, my1, all1 = stats.cpu_seconds(), me.cpu_seconds(), machine_busy_seconds()
    m1 = await asyncio.to_thread(scrape, url)
    d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
    steps = d.get("tim_step_seconds_count", 0.0)
    stop.set()
    await sampler
    admitted = [c for c in clients if c.refused is None]
    lat = np.array([x for c in admitted for x in c.latencies]) * 1000
    budget = args.budget_ms
    errors = [f"client {c.index}: {c.error}" for c in clients if c.error]
    refused = [c for c in clients if c.refused is not None]
    return {
        "offered": len(clients), "admitted": len(admitted), "refused": len(refused),
        "refused_1013_with_capacity": sum(c.close_code == 1013 and c.refused.get("code") == 1013
                                          and "capacity" in c.refused and "retry_after_s" in c.refused
                                          for c in refused),
        "late_notices": sum(c.events["late"] for c in admitted), "gaps": sum(c.events["gap"] for c in admitted),
        "gap_ms": round(1000 * sum(c.gap_samples for c in admitted) / rate, 1),
        "server_late_hops": int(d.get("tim_late_hops_total", 0.0)),
        "server_skipped_hops": int(d.get("tim_skipped_hops_total", 0.0)),
        "streams": args.streams, "seconds": args.seconds, "rate": rate, "chunk_ms": args.chunk_ms,
        "messages": int(lat.size), "late": int((lat > budget).sum()), "budget_ms": budget,
        "latency_p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
        "latency_p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
        "latency_max_ms": float(lat.max()) if lat.size else None,
        "server_cpu_pct": 100 * (cpu1 - cpu0) / wall, "client_cpu_pct": 100 * (my1 - my0) / wall,
        "other_cpu_pct": 100 * ((all1 - all0) - (cpu1 - cpu0) - (my1 - my0)) / wall,
        "server_peak_rss_mb": stats.peak_rss, "errors": errors,
        "steps": int(steps), "mean_batch": d.get("tim_batch_size_sum", 0.0) / steps if steps else None,
        "mean_step_ms": 1000 * d.get("tim_step_seconds_sum", 0.0) / steps if steps else None,
        "step_busy_pct": 100 * d.get("tim_step_seconds_sum", 0.0) / wall,
        "complete": all(c.samples_out == len(c.sent_times) * c.chunk for c in admitted if not c.error),
    } | stall_figures(d, probe) | late_attribution(clients, budget, observer, probe)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.loadtest", description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--url", help="websocket URL of a running server (default: start one)")
    p.add_argument("--server-pid", type=int, help="PID of the server at --url, for CPU and memory figures")
    p.add_argument("--model", help="model for the started server (default: shipped, else random-weight tim)")
    p.add_argument("--workers", type=int, default=2, help="inference workers of the started server")
    p.add_argument("--threads", type=int, default=1, help="onnxruntime threads per worker")
    p.add_argument("--file", help="audio to stream (default: the dev set's noisy files)")
    p.add_argument("--rate", type=int, help="resample the file to this rate before streaming")
    p.add_argument("--chunk-ms", type=float, default=20.0)
    p.add_argument("--budget-ms", type=float, help="late threshold (default: the stream's latency at its rate + chunk + 64 ms)")
    p.add_argument("--overload", type=float, nargs="?", const=2.0, metavar="FACTOR",
                   help="offer FACTOR (default 2) x the server's measured capacity (--streams is ignored)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    audio, rate = load_audio(args.file, args.rate)
    proc = None
    url, pid = args.url, args.server_pid
    if url is None:
        model = model_path(args.model)
        proc, url = start_server(model, args.streams, args.workers, args.threads, calibrate=args.overload is not None)
        pid = proc.pid
    base = url.replace("ws", "http", 1).rsplit("/v1/", 1)[0]
    try:
        import httpx

        ready = httpx.get(base + "/readyz", timeout=5).json()
        if args.budget_ms is None:
            args.budget_ms = default_budget_ms(ready, rate, args.chunk_ms)
        capacity = ready.get("capacity", {})
        if args.overload is not None:
            args.streams = max(1, math.ceil(args.overload * capacity["streams"]))
            print(f"capacity {capacity['streams']} live streams ({'measured' if capacity.get('calibrated') else 'fixed'}"
                  f", per worker {capacity.get('per_worker')}, step median by batch {capacity.get('step_p50_ms')}, tail factor {capacity.get('tail_factor')}); "
                  f"offering {args.streams}", file=sys.stderr, flush=True)
        freeze_startup_objects()
        result = asyncio.run(measure(url, audio, rate, args, pid))
        result["capacity"] = capacity.get("streams")
        result["healthy"] = all(httpx.get(base + path, timeout=5).status_code == 200 for path in ("/healthz", "/readyz"))
    finally:
        if proc is not None:
            proc.stop()
    if args.json:
        print(json.dumps(result))
    else:
        if args.overload is not None:
            print(f"overload x{args.overload:g}: offered {result['offered']} streams to a capacity of "
                  f"{result['capacity']}: admitted {result['admitted']}, refused {result['refused']} "
                  f"({result['refused_1013_with_capacity']} with close 1013 and the JSON error); healthy after: "
                  f"{result['healthy']}")
        print(f"  server: late hops {result['server_late_hops']}, skipped hops {result['server_skipped_hops']}; "
              f"clients told: late {result['late_notices']}, gaps {result['gaps']} ({result['gap_ms']} ms)")
        print(f"{result['streams']} streams x {result['seconds']:g} s at {rate} Hz, {args.chunk_ms:g} ms chunks: "
              f"{result['late']} late of {result['messages']} messages (budget {result['budget_ms']:.0f} ms); "
              f"latency p50 {result['latency_p50_ms']:.1f} ms, p99 {result['latency_p99_ms']:.1f} ms, "
              f"max {result['latency_max_ms']:.1f} ms; server CPU {result['server_cpu_pct']:.0f} % "
              f"(client {result['client_cpu_pct']:.0f} %, other processes {result['other_cpu_pct']:.0f} %), server peak RSS {result['server_peak_rss_mb']:.0f} MB; "
              f"complete: {result['complete']}")
        if result["steps"]:
            print(f"  {result['steps']} steps, mean batch {result['mean_batch']:.1f} lanes, mean step "
                  f"{result['mean_step_ms']:.2f} ms, inference busy {result['step_busy_pct']:.0f} % of one core")
        print(f"  machine stalls > 32 ms (idle observer process): {result['machine_stalls']} (max "
              f"{result['machine_stall_max_ms']} ms); late messages within 1.5 s of one: "
              f"{result['late_in_machine_stalls']}, of a load generator stall: {result['late_in_client_stalls']}, "
              f"other late messages: {result['late_other']}")
        print(f"  stalls > 32 ms: server event loop {result['server_loop_stalls']}, load generator "
              f"{result['client_loop_stalls']} (its max {result['client_loop_max_lag_ms']} ms); server full "
              f"collections {result['server_full_gcs']} ({result['server_full_gc_ms']} ms in total)")
        for e in result["errors"][:10]:
            print("  error:", e)
    ok = not result["errors"] and result["complete"] and result["healthy"]
    if args.overload is not None:  # the acceptance of overload: on time apart from stalls, the rest refused clearly
        ok = ok and result["late_other"] == 0 and result["refused_1013_with_capacity"] == result["refused"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
