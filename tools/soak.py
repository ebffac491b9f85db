"""Soak: the load benchmark for N minutes at a given stream count with the server's memory sampled
throughout, then connect/disconnect cycles; a table and a plot.

    python -m tools.soak --streams 16 --minutes 10                  # starts a server
    python -m tools.soak --streams 16 --minutes 10 --url ws://127.0.0.1:8000/v1/stream --server-pid PID
    python -m tools.soak --streams 2 --minutes 0.5 --cycles 200      # a quick check of the tooling

Loopback only. Late messages, latency and errors come from `tools.loadtest`'s clients; RSS,
descriptors and threads of the server from /proc every `--sample-s`. RSS growth compares the
median of the last `--window-s` with that of the first window after `--warmup-s` (allocator
pools, onnxruntime's arena and caches fill during warm-up), and that of the middle of the run (a
leak keeps growing in the second half, a warm-up does not). Writes soak.json, soak.md and soak.png
to --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from . import REPO_ROOT, loadtest
from .machine_stalls import STALL_S
from .rawws import RawClient


# ---------------------------------------------------------------------------------- sampling
def proc_sample(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:")) / 1024
    threads = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("Threads:"))
    return {"rss_mb": rss, "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": threads}


async def sampler(pid: int, t0: float, every: float, stop: asyncio.Event, out: list) -> None:
    while True:
        out.append({"t": time.perf_counter() - t0} | proc_sample(pid))
        try:
            await asyncio.wait_for(stop.wait(), every)
            return
        except asyncio.TimeoutError:
            pass


def server_errors(url: str) -> dict[str, float]:
    errors = {}
    for line in loadtest.metrics_lines(url):
        if line.startswith("tim_errors_total{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            errors[kind] = float(line.split()[-1])
    return errors


# ---------------------------------------------------------------------------------- phases
async def soak(url: str, pid: int, audio, rate: int, args) -> dict:
    samples: list[dict] = []
    stop = asyncio.Event()
    t0 = time.perf_counter()
    task = asyncio.create_task(sampler(pid, t0, args.sample_s, stop, samples))
    errors0 = await asyncio.to_thread(server_errors, url)
    m0 = await asyncio.to_thread(loadtest.scrape, url)
    load = argparse.Namespace(streams=args.streams, seconds=args.minutes * 60, chunk_ms=args.chunk_ms)
    clients, probe, observer = await loadtest.run_observed(url, audio, rate, load)
    errors1 = await asyncio.to_thread(server_errors, url)
    m1 = await asyncio.to_thread(loadtest.scrape, url)
    stop.set()
    await task
    stalls = loadtest.stall_figures({k: m1[k] - m0.get(k, 0.0) for k in m1}, probe)
    stalls |= loadtest.late_attribution(clients, args.budget_ms, observer, probe)
    return {"clients": clients, "samples": samples, "t0": t0, "stalls": stalls,
            "client_stalls": [(t - t0, lag) for t, lag in probe.events],
            "machine_stalls": [(t - t0, lag) for t, lag in observer.events],
            "server_errors": {k: v - errors0.get(k, 0) for k, v in errors1.items() if v - errors0.get(k, 0)}}


def cycles(host: str, port: int, n: int, pid: int, parallel: int = 8) -> dict:
    """`n` connect / start / audio / disconnect cycles (clean end, close frame, RST, gone before
    the start), `parallel` at a time, after 100 to warm up: server RSS and descriptors before/after."""
    audio = np.zeros(1600, "<i2").tobytes()

    def cycle(i):
        c = RawClient.connect(host, port, "/v1/stream")
        if i % 4 == 3:
            c.abort()
            return
        c.send_text('{"sample_rate": 16000}')
        c.recv_frame()
        c.send_binary(audio)
        if i % 4 == 0:
            c.send_text('{"type": "end"}')
            c.recv_until_close()
        elif i % 4 == 1:
            c.send_close(1000)
            c.recv_until_close()
        c.abort() if i % 4 == 2 else c.close()

    def run(k):
        with ThreadPoolExecutor(parallel) as pool:
            list(pool.map(cycle, range(k)))
        time.sleep(1.0)  # the server finishes closing

    run(100)
    before = proc_sample(pid)
    t = time.perf_counter()
    run(n)
    after = proc_sample(pid)
    return {"cycles": n, "seconds": round(time.perf_counter() - t, 1), "before": before, "after": after,
            "rss_growth_mb": round(after["rss_mb"] - before["rss_mb"], 1), "fd_growth": after["fds"] - before["fds"]}


# ---------------------------------------------------------------------------------- figures
def windows(clients, t0: float, seconds: float, width: float, budget_ms: float) -> list[dict]:
    """Per window of `width` s: messages, late messages, latency p50/p99. The windows run to the last
    arrival (past `seconds` when a loaded machine delivers the tails late), so they add up to the totals."""
    t = np.concatenate([np.asarray(c.arrivals) for c in clients]) - t0 if clients else np.zeros(0)
    lat = np.concatenate([np.asarray(c.latencies) for c in clients]) * 1000 if clients else np.zeros(0)
    end = max(seconds, float(t.max()) if t.size else 0.0)
    out = []
    for start in np.arange(0, end + width / 2, width):
        m = (t >= start) & (t < start + width)
        w = lat[m]
        out.append({"t": float(start), "messages": int(w.size), "late": int((w > budget_ms).sum()),
                    "p50_ms": float(np.percentile(w, 50)) if w.size else None,
                    "p99_ms": float(np.percentile(w, 99)) if w.size else None})
    return out


def rss_growth(samples: list[dict], warmup_s: float, window_s: float) -> dict:
    t = np.array([s["t"] for s in samples])
    rss = np.array([s["rss_mb"] for s in samples])
    end = t.max() if t.size else 0.0
    first = rss[(t >= warmup_s) & (t < warmup_s + window_s)]
    last = rss[t >= end - window_s]
    if not first.size:  # a short run: the first sample after warm-up, or the first at all
        first = rss[t >= min(warmup_s, end)][:1] if t.size else rss[:1]
    base, final = float(np.median(first)), float(np.median(last))
    middle = rss[(t >= end / 2 - window_s / 2) & (t < end / 2 + window_s / 2)]
    mid = float(np.median(middle)) if middle.size else base
    return {"base_mb": round(base, 1), "end_mb": round(final, 1), "peak_mb": round(float(rss.max()), 1),
            "growth_pct": round(100 * (final - base) / base, 2) if base else None,
            "second_half_growth_pct": round(100 * (final - mid) / mid, 2) if mid else None}


def summarize(run: dict, cyc: dict | None, args, budget_ms: float) -> dict:
    clients = run["clients"]
    lat = np.concatenate([np.asarray(c.latencies) for c in clients]) * 1000
    errors = [f"client {c.index}: {c.error}" for c in clients if c.error]
    complete = all(c.samples_out == len(c.sent_times) * c.chunk for c in clients if not c.error)
    growth = rss_growth(run["samples"], args.warmup_s, args.window_s)
    result = {
        "streams": args.streams, "minutes": args.minutes, "budget_ms": budget_ms, "messages": int(lat.size),
        "late": int((lat > budget_ms).sum()),
        "latency_p50_ms": round(float(np.percentile(lat, 50)), 1) if lat.size else None,
        "latency_p99_ms": round(float(np.percentile(lat, 99)), 1) if lat.size else None,
        "latency_max_ms": round(float(lat.max()), 1) if lat.size else None,
        "client_errors": errors, "server_errors": run["server_errors"], "complete": complete, "rss": growth,
        "fds": [run["samples"][0]["fds"], run["samples"][-1]["fds"]] if run["samples"] else None,
        "cycles": cyc, "windows": windows(clients, run["t0"], args.minutes * 60, args.window_s, budget_ms),
        "samples": run["samples"], "stalls": run["stalls"], "client_stalls": run["client_stalls"],
        "machine_stalls": run["machine_stalls"],
    }
    rest_ok = bool(not errors and not run["server_errors"] and complete
                   and growth["growth_pct"] is not None and growth["growth_pct"] < args.max_growth_pct
                   and (cyc is None or (cyc["rss_growth_mb"] < args.max_cycle_growth_mb and cyc["fd_growth"] <= 2)))
    result["pass"] = rest_ok and result["late"] == 0
    # the same verdict when late messages during and right after stalls of the whole machine (which
    # an idle observer process sees too) or of the load generator are set aside: what the service
    # itself is answerable for
    result["pass_outside_stalls"] = rest_ok and run["stalls"]["late_other"] == 0
    return result


def table(r: dict) -> str:
    rss, cyc = r["rss"], r["cycles"]
    rows = [("streams x duration", f"{r['streams']} x {r['minutes']:g} min"),
            ("late messages", f"{r['late']} of {r['messages']:,} (budget {r['budget_ms']:.0f} ms)"),
            ("latency p50 / p99 / max", f"{r['latency_p50_ms']} / {r['latency_p99_ms']} / {r['latency_max_ms']} ms"),
            ("errors (clients, server)", f"{len(r['client_errors'])}, {sum(r['server_errors'].values()):g}"),
            ("all output received", str(r["complete"])),
            ("late messages within 1.5 s of a machine stall / of a load generator stall / other",
             f"{r['stalls']['late_in_machine_stalls']} / {r['stalls']['late_in_client_stalls']} / "
             f"{r['stalls']['late_other']} (machine stalls > 32 ms seen by an idle observer process: "
             f"{r['stalls']['machine_stalls']}, longest {r['stalls']['machine_stall_max_ms']} ms)"),
            ("stalls > 32 ms: server loop, load generator",
             f"{r['stalls']['server_loop_stalls']}, {r['stalls']['client_loop_stalls']} (load generator max "
             f"{r['stalls']['client_loop_max_lag_ms']} ms); server full collections {r['stalls']['server_full_gcs']} "
             f"({r['stalls']['server_full_gc_ms']} ms)"),
            ("server RSS after warm-up -> end (peak)",
             f"{rss['base_mb']} -> {rss['end_mb']} MB ({rss['growth_pct']:+.2f} %; second half "
             f"{rss['second_half_growth_pct']:+.2f} %; peak {rss['peak_mb']} MB)"),
            ("server descriptors start -> end", f"{r['fds'][0]} -> {r['fds'][1]}" if r["fds"] else "-")]
    if cyc:
        rows.append((f"{cyc['cycles']} connect/disconnect cycles",
                     f"RSS {cyc['before']['rss_mb']:.1f} -> {cyc['after']['rss_mb']:.1f} MB "
                     f"({cyc['rss_growth_mb']:+.1f} MB), descriptors {cyc['fd_growth']:+d}, {cyc['seconds']} s"))
    rows.append(("pass (0 late)", str(r["pass"])))
    rows.append(("pass, late messages in machine and load generator stalls set aside", str(r["pass_outside_stalls"])))
    return "| measure | value |\n| --- | --- |\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, w = r["samples"], [x for x in r["windows"] if x["messages"]]
    fig, ax = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    ax[0].plot([x["t"] / 60 for x in s], [x["rss_mb"] for x in s], color="tab:blue")
    ax[0].axhline(r["rss"]["base_mb"] * (1 + 0.05), color="tab:red", ls="--", lw=0.8, label="+5 % of post-warm-up RSS")
    ax[0].set_ylabel("server RSS (MB)")
    ax[0].legend(loc="lower right")
    ax[1].plot([x["t"] / 60 for x in w], [x["p99_ms"] for x in w], label="p99", color="tab:orange")
    ax[1].plot([x["t"] / 60 for x in w], [x["p50_ms"] for x in w], label="p50", color="tab:green")
    ax[1].axhline(r["budget_ms"], color="tab:red", ls="--", lw=0.8, label="late budget")
    ax[1].set_ylabel("latency (ms)")
    ax[1].legend(loc="upper right")
    ax[2].bar([x["t"] / 60 for x in w], [x["late"] for x in w], width=(w[1]["t"] - w[0]["t"]) / 60 if len(w) > 1 else 0.1,
              color="tab:red", align="edge")
    for t, lag in r.get("machine_stalls", []):
        if lag > STALL_S:
            ax[2].axvline(t / 60, color="tab:purple", lw=0.6, alpha=0.6)
    ax[2].set_ylabel("late messages\n(purple: machine\nstalled > 32 ms)")
    ax[2].set_xlabel("minutes")
    fig.suptitle(f"soak: {r['streams']} real-time streams, {r['minutes']:g} min; late {r['late']} of {r['messages']:,}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.soak", description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--cycles", type=int, default=1000, help="connect/disconnect cycles after the soak (0: none)")
    p.add_argument("--url", help="websocket URL of a running loopback server (default: start one)")
    p.add_argument("--server-pid", type=int, help="PID of the server at --url (required with --url)")
    p.add_argument("--model", help="model for the started server (default: shipped, else random-weight tim)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--file", help="audio to stream (default: the dev set's noisy files)")
    p.add_argument("--rate", type=int, help="resample the file to this rate before streaming")
    p.add_argument("--chunk-ms", type=float, default=20.0)
    p.add_argument("--budget-ms", type=float, help="late threshold (default: latency + chunk + 64 ms)")
    p.add_argument("--sample-s", type=float, default=2.0, help="RSS sampling period")
    p.add_argument("--warmup-s", type=float, default=120.0, help="RSS growth is measured from here (onnxruntime's "
                   "memory arena grows until every batch size has been seen, then stays flat)")
    p.add_argument("--window-s", type=float, default=30.0)
    p.add_argument("--max-growth-pct", type=float, default=5.0)
    p.add_argument("--max-cycle-growth-mb", type=float, default=10.0)
    p.add_argument("--out", default=str(REPO_ROOT / "artifacts" / "reliability" / "soak"))
    args = p.parse_args(argv)
    if args.url and not args.server_pid:
        p.error("--url needs --server-pid (memory is sampled from /proc)")
    if args.url and "//127.0.0.1:" not in args.url and "//localhost:" not in args.url:
        p.error("--url must be a loopback server")
    args.warmup_s = min(args.warmup_s, args.minutes * 60 / 4)
    args.window_s = min(args.window_s, max(args.minutes * 60 / 4, 2 * args.sample_s))
    audio, rate = loadtest.load_audio(args.file, args.rate)
    proc = None
    url, pid = args.url, args.server_pid
    if url is None:
        proc, url = loadtest.start_server(loadtest.model_path(args.model), max(args.streams, 8), args.workers, 1)
        pid = proc.pid
    try:
        import httpx

        base = url.replace("ws", "http", 1).rsplit("/v1/", 1)[0]
        budget = args.budget_ms or loadtest.default_budget_ms(httpx.get(base + "/readyz", timeout=5).json(), rate, args.chunk_ms)
        args.budget_ms = budget
        loadtest.freeze_startup_objects()  # the load generator's full collections would look like late audio
        run = asyncio.run(soak(url, pid, audio, rate, args))
        host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
        cyc = cycles(host, int(port), args.cycles, pid) if args.cycles else None
    finally:
        if proc is not None:
            proc.stop()
    result = summarize(run, cyc, args, budget)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    (out / "soak.md").write_text(table(result))
    plot(result, out / "soak.png")
    print(table(result))
    for e in result["client_errors"][:10]:
        print("  error:", e)
    print(f"written: {out / 'soak.json'}, {out / 'soak.md'}, {out / 'soak.png'}")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
