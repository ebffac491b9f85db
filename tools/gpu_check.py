"""The GPU check: the model and the service under CUDA, measured, written as JSON.

    python -m tools.gpu_check --out DIR                       # on a machine with a GPU
    python -m tools.gpu_check --out DIR --device cpu --quick  # the same stages on the CPU (a rehearsal)

`make gpu-check` installs a carried onnxruntime-gpu first (see the Makefile). Stages, each recorded
even when another fails:

1. environment: GPU, driver, CUDA libraries, onnxruntime and its providers;
2. `enhancer info --device cuda` for each model: the provider in use and where stream state lives;
3. parity with the CPU: a file, and 8 concurrent streams sharing one lane pool fed in chunks of
   different sizes, each against the CPU's output for the same signal (tolerance: the export's,
   `MAX_REL_DIFF` of the output's peak for float graphs, 30 dB output/difference for 8-bit ones);
4. `enhancer bench --device cuda` at batch 1, 16, 64, 256 and 1024 (p50/p99 ms per step, the
   largest batch whose p99 fits the 16 ms hop: streams per GPU in real time);
5. the load test against a server on the GPU: `--load-streams` live websocket streams, driven by
   `--clients` load generator processes: admitted, refused, late messages, latency p50/p99.

Everything goes to DIR/gpu-check.json (rewritten after each stage) and a table at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from . import REPO_ROOT
from .gpu_check_load import FILE, load_test, load_test_servers, load_test_step_server

EIGHT_BIT_SNR_DB = 30.0  # the export's bar for 8-bit graphs (output over its difference)


def _cmd(args: list[str], timeout: float = 600.0) -> tuple[int, str, str]:
    p = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    return p.returncode, p.stdout, p.stderr


def environment() -> dict:
    import onnxruntime as ort

    from enhancer.engine import preload_cuda_libraries

    env = {"python": platform.python_version(), "onnxruntime": ort.__version__, "onnxruntime_file": ort.__file__,
           "cuda_libraries_preloaded": preload_cuda_libraries(), "providers": ort.get_available_providers(),
           "cpus": os.cpu_count()}
    try:
        rc, out, _ = _cmd(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                           "--format=csv,noheader"], timeout=30)
        env["gpu"] = out.strip() if rc == 0 else None
        rc, out, _ = _cmd(["nvidia-smi"], timeout=30)
        env["cuda_driver_api"] = next((line.split("CUDA Version:")[1].strip(" |") for line in out.splitlines()
                                       if "CUDA Version:" in line), None)
    except (OSError, subprocess.TimeoutExpired):
        env["gpu"] = None
    from importlib.metadata import PackageNotFoundError, version

    libs = {}
    for name in ("nvidia-cuda-runtime", "nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-curand", "nvidia-cufft"):
        try:
            libs[name] = version(name)
        except PackageNotFoundError:
            pass
    env["cuda_packages"] = libs
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
        env["cpu"] = cpu
    except (OSError, StopIteration):
        pass
    return env


def info(model: Path, device: str, device_pool: bool = False) -> dict:
    rc, out, err = _cmd([sys.executable, "-m", "enhancer", "info", str(model), "--device", device, "--json",
                         "--device-pool" if device_pool else "--no-device-pool"], timeout=120)
    if rc != 0:
        return {"rc": rc, "error": err.strip()[-2000:]}
    d = json.loads(out)
    return {k: d.get(k) for k in ("provider", "available_providers", "onnxruntime", "stream_state", "weights", "rings",
                                  "parameters", "file")}


def _compare(got: np.ndarray, want: np.ndarray) -> dict:
    diff = got.astype(np.float64) - want
    peak = float(np.abs(want).max())
    energy, err = float(np.sum(want.astype(np.float64) ** 2)), float(np.sum(diff ** 2))
    return {"max_abs_diff": float(np.abs(diff).max()), "max_rel_diff": float(np.abs(diff).max() / peak) if peak else None,
            "snr_db": float("inf") if err == 0 else 10 * np.log10(energy / err), "samples": int(want.size),
            "finite": bool(np.isfinite(got).all())}


def parity(model: Path, device: str, streams: int = 8, full_steps: bool = False, device_pool: bool = False) -> dict:
    """A file, then `streams` concurrent streams in one pool (`make_pool` with `full_steps` and
    `device_pool`), on `device` against the CPU."""
    import soundfile as sf

    from enhancer.build.export import MAX_REL_DIFF
    from enhancer.device_pool import make_pool
    from enhancer.runtime import Enhancer

    cpu = Enhancer.from_pretrained(model, providers=["CPUExecutionProvider"])
    dev = Enhancer.from_pretrained(model, providers=None if device == "cuda" else ["CPUExecutionProvider"])
    x, sr = sf.read(str(FILE), dtype="float32")
    eight_bit = cpu.engine.weights == "int8" or cpu.engine.int8_rings

    def ok(c: dict) -> bool:
        if not c["finite"]:
            return False
        return c["snr_db"] >= EIGHT_BIT_SNR_DB if eight_bit else c["max_rel_diff"] <= MAX_REL_DIFF

    res = {"provider": dev.provider, "tolerance": f">= {EIGHT_BIT_SNR_DB:g} dB" if eight_bit else
           f"max_rel_diff <= {MAX_REL_DIFF:g}", "file": str(FILE.relative_to(REPO_ROOT))}
    f = _compare(dev.enhance(x, sr), cpu.enhance(x, sr))
    res["file_parity"] = f | {"ok": ok(f)}
    # streams: different signals (shifted, scaled, reversed), fed in interleaved chunks of different sizes
    rng = np.random.default_rng(0)
    signals = [np.roll(x, 1601 * i) * (0.5 + 0.1 * i) * (1 if i % 2 else -1) for i in range(streams)]
    pool = make_pool(dev.engine, streams, full_steps=full_steps, device_pool=device_pool)
    res["pool"] = type(pool).__name__ + (" (full-pool live steps)" if pool.full_step is not None else "")
    if getattr(pool, "full_step_error", None):
        res["full_step_error"] = pool.full_step_error
    live = [dev.stream(sr, pool=pool) for _ in range(streams)]
    outs: list[list[np.ndarray]] = [[] for _ in range(streams)]
    pos = [0] * streams
    while any(p < len(s) for p, s in zip(pos, signals)):
        for i in rng.permutation(streams):
            if pos[i] >= len(signals[i]):
                continue
            n = int(rng.choice([256, 320, 1000, 4096]))
            outs[i].append(live[i].feed(signals[i][pos[i]:pos[i] + n]))
            pos[i] += n
    per = []
    for i in range(streams):
        outs[i].append(live[i].flush())
        c = _compare(np.concatenate(outs[i]), cpu.enhance(signals[i], sr))
        per.append(c | {"ok": ok(c)})
    res["streams"] = streams
    res["stream_parity"] = per
    res["worst_stream_max_rel_diff"] = max(c["max_rel_diff"] for c in per)
    res["worst_stream_snr_db"] = min(c["snr_db"] for c in per)
    res["ok"] = res["file_parity"]["ok"] and all(c["ok"] for c in per)
    return res


def bench(model: Path, device: str, batches: str, steps: int, full_steps: bool = False, device_pool: bool = False) -> dict:
    switches = ["--full-steps" if full_steps else "--no-full-steps", "--device-pool" if device_pool else "--no-device-pool"]
    rc, out, err = _cmd([sys.executable, "-m", "enhancer", "bench", "--model", str(model), "--device", device,
                         "--batches", batches, "--steps", str(steps), "--json", *switches], timeout=300)
    if rc != 0:
        return {"rc": rc, "error": err.strip()[-3000:]}
    return json.loads(out)


def profile_step(model: Path, device: str, batches=(1, 64, 1024), steps: int = 100, full_steps: bool = False) -> dict:
    """Where a device-pool step's time goes: the step graph's run alone against the whole
    `DeviceLanePool.step` (the step plus the lane graphs' writes), by batch size."""
    from enhancer.device_pool import DeviceLanePool
    from enhancer.runtime import Enhancer

    enh = Enhancer.from_pretrained(model, providers=None if device == "cuda" else ["CPUExecutionProvider"])
    eng = enh.engine
    out = {"provider": enh.provider, "batches": []}
    for b in batches:
        pool = DeviceLanePool(eng, b, full_steps=full_steps)
        if full_steps and pool.full_step is None:
            out["batches"].append({"batch": b, "error": pool.full_step_error})
            continue
        lanes = pool.alloc(b)
        x = (np.random.default_rng(0).standard_normal((b, eng.config.stft.hop)) * 0.05).astype(np.float32)
        g = np.zeros(b, np.float32)
        for _ in range(20):
            pool.step(lanes, x, g)
        t_all = []
        for _ in range(steps):
            t = time.perf_counter()
            pool.step(lanes, x, g)
            t_all.append(time.perf_counter() - t)
        calls = {"step": [], "writers": []}
        sess = pool.full_step.session if pool.full_step is not None else eng.session
        run, place = sess.run_with_iobinding, pool._write

        def timed_run(io, *a, _run=run, _calls=calls):
            t = time.perf_counter()
            _run(io, *a)
            _calls["step"].append(time.perf_counter() - t)

        def timed_place(*a, _place=place, _calls=calls):
            t = time.perf_counter()
            _place(*a)
            _calls["writers"].append(time.perf_counter() - t)

        sess.run_with_iobinding, pool._write = timed_run, timed_place
        try:
            for _ in range(steps):
                pool.step(lanes, x, g)
        finally:
            del sess.run_with_iobinding
        n_writers = len(calls["writers"]) // steps
        out["batches"].append({
            "batch": b, "pool_step_p50_ms": 1000 * float(np.median(t_all)), "pool_step_p99_ms": 1000 * float(np.percentile(t_all, 99)),
            "graph_run_p50_ms": 1000 * float(np.median(calls["step"])),
            "writers_per_step": n_writers,
            "writers_p50_ms_per_step": 1000 * float(np.median(np.array(calls["writers"]).reshape(steps, -1).sum(axis=1))),
        })
        del pool
    return out


def _parity_line(p: dict) -> str:
    f = p["file_parity"]
    return (f"file rel {f['max_rel_diff']:.2e} ({f['snr_db']:.1f} dB); {p['streams']} streams worst rel "
            f"{p['worst_stream_max_rel_diff']:.2e} ({p['worst_stream_snr_db']:.1f} dB) [{p['tolerance']}]: "
            f"{'ok' if p['ok'] else 'FAIL'} ({p['pool']})")


def _bench_line(b: dict) -> str:
    steps = "; ".join(f"b{s['batch']} {s['p50_ms']:.2f}/{s['p99_ms']:.2f}" for s in b["step"])
    return (f"({b['provider']}): {steps} ms p50/p99; streams in real time {b['streams_per_core']}; offline RTF "
            f"{b['offline_rtf']:.4f}")


def _profile_line(r: dict) -> str:
    return (f"pool step p50 {r['pool_step_p50_ms']:.2f} ms = graph run {r['graph_run_p50_ms']:.2f} + "
            f"{r['writers_per_step']} lane-writer call(s) {r['writers_p50_ms_per_step']:.2f} + the rest")


def _load_line(m: dict) -> str:
    return (f"capacity {m['capacity']}, admitted {m['admitted']} of {m['offered']}, refused {m['refused']}, late "
            f"{m['late']} ({m['late_other']} apart from stalls) of {m['messages']}, p50 {m['latency_p50_ms_median']} ms, "
            f"worst p99 {m['latency_p99_ms_worst']} ms, ok {m['ok']}")


def summary(report: dict) -> str:
    lines = [f"GPU check ({report['device']}), {report.get('environment', {}).get('gpu')}"]
    for name, i in report.get("info", {}).items():
        lines.append(f"info {name}: provider {i.get('provider')}, stream state {i.get('stream_state')}, "
                     f"weights {i.get('weights')}, rings {i.get('rings')} {i.get('error', '')}")
    rows = [(f"{k} {n}", v, _parity_line) for k in ("parity", "parity_full") for n, v in report.get(k, {}).items()]
    rows += [(f"{k} {n}", v, _bench_line) for k in ("bench", "bench_full") for n, v in report.get(k, {}).items()]
    rows += [(f"{k} b{r['batch']}", r, _profile_line) for k in ("profile", "profile_full")
             for r in report.get(k, {}).get("batches", [])]
    rows += [(f"load {key}", m, _load_line) for key, m in report.get("load_servers", {}).items()]
    rows += [(f"step server {key}", m, _load_line) for key, m in report.get("load_step_server", {}).items()]
    lt = report.get("load_test", {})
    rows += [(f"load {lv['streams']} streams ({lv['clients']} clients, budget {lv['budget_ms']} ms)", lv, _load_line)
             for lv in lt.get("levels", [])]
    for label, value, line in rows:
        ok = "error" not in value and ("admitted" in value or line is not _load_line)
        lines.append(f"{label}: {line(value)}" if ok else f"{label}: ERROR {str(value.get('error', value))[-400:]}")
    if "error" in lt:
        lines.append(f"load test: ERROR {lt['error'][-500:]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for gpu-check.json")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--model", action="append", default=None,
                   help="step graphs to check (default: the shipped one); the first is benchmarked at every batch "
                        "and load tested")
    p.add_argument("--batches", default="1,16,64,256,1024")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--load-streams", default="64,128,256", help="live streams per load-test level")
    p.add_argument("--clients", type=int, default=8, help="load generator processes")
    p.add_argument("--seconds", type=float, default=15.0, help="length of each load-test level")
    p.add_argument("--servers", default="", help="also: load tests with these numbers of server processes on the "
                   "device, each calibrated and offered --offer x its capacity (comma-separated, e.g. 1,4,8)")
    p.add_argument("--server-max-streams", type=int, default=128, help="--servers: the most streams one process admits")
    p.add_argument("--offer", type=float, default=1.25, help="--servers: streams offered per capacity")
    p.add_argument("--batch-wait-ms", type=float, default=12.0, help="--servers: the servers' max_batch_wait_ms")
    p.add_argument("--step-server", default="", metavar="NxS,...", help="also: load tests with one step server on "
                   "the device and N service processes stepping through it, S live streams each (e.g. 4x32,6x48)")
    p.add_argument("--full-steps", action="store_true", help="also profile and bench full-pool live steps (a CUDA "
                   "graph under CUDA); the step-server load tests after it use them too")
    p.add_argument("--device-pool", action="store_true", help="keep stream state in the device pool on the CPU too "
                   "(parity and bench: a rehearsal of the GPU's code path with --device cpu)")
    p.add_argument("--quick", action="store_true", help="small sizes (a rehearsal on the CPU)")
    p.add_argument("--skip", default="", help="stages to skip, comma-separated (info, parity, bench, load, profile; "
                   "with --full-steps also parity_full, bench_full)")
    a = p.parse_args(argv)
    if a.quick:
        a.batches, a.steps, a.load_streams, a.clients, a.seconds = "1,4", 30, "2,4", 2, 3.0
    from enhancer.runtime import default_model_path

    models = [Path(m) for m in (a.model or [default_model_path()])]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, a.skip.split(",")))
    report: dict = {"device": a.device, "models": [str(m) for m in models], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                                   time.gmtime())}

    def save() -> None:
        (out / "gpu-check.json").write_text(json.dumps(report, indent=2, default=str))

    def stage(name: str, key: str | None, fn, *args) -> None:
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            value = fn(*args)
        except Exception as e:  # recorded; the next stage runs
            value = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}
        value_t = round(time.perf_counter() - t0, 1)
        if key is None:
            report[name] = value
        else:
            report.setdefault(name, {})[key] = value
        report.setdefault("stage_seconds", {})[f"{name}:{key}" if key else name] = value_t
        save()

    stage("environment", None, environment)
    print(json.dumps(report["environment"], default=str), flush=True)
    for m in models:
        if "info" not in skip:
            stage("info", m.name, info, m, a.device, a.device_pool)
        if "parity" not in skip:
            stage("parity", m.name, parity, m, a.device, 8, False, a.device_pool)
    if "bench" not in skip:
        stage("bench", models[0].name, bench, models[0], a.device, a.batches, a.steps, False, a.device_pool)
    if "load" not in skip:
        levels = [int(x) for x in a.load_streams.split(",")]
        stage("load_test", None, load_test, models[0], a.device, levels, a.clients, a.seconds)
    if "profile" not in skip:
        stage("profile", None, profile_step, models[0], a.device, (1, 4) if a.quick else (1, 64, 1024), 30 if a.quick else 100)
    if a.full_steps:  # the same with full-pool live steps (a CUDA graph under CUDA): parity, profile, bench
        if "parity_full" not in skip:
            stage("parity_full", models[0].name, parity, models[0], a.device, 8, True, a.device_pool)
        if "profile" not in skip:
            stage("profile_full", None, profile_step, models[0], a.device, (4, 8) if a.quick else (64, 256, 1024),
                  30 if a.quick else 100, True)
        if "bench_full" not in skip:
            stage("bench_full", models[0].name, bench, models[0], a.device, a.batches, a.steps, True, a.device_pool)
    for spec in [x for x in a.step_server.split(",") if x]:
        fronts, per = (int(v) for v in spec.lower().split("x"))
        stage("load_step_server", spec, load_test_step_server, models[0], a.device, fronts, per, a.seconds,
              a.batch_wait_ms, 1024, a.full_steps)
    for n in [int(x) for x in a.servers.split(",") if x]:
        stage("load_servers", f"{n}x", load_test_servers, models[0], a.device, n, a.server_max_streams, a.offer,
              a.seconds, a.batch_wait_ms, a.full_steps)
    if "bench" not in skip:
        for m in models[1:]:  # the others at the small batches (a host lane pool at large ones moves the rings)
            stage("bench", m.name, bench, m, a.device, ",".join(a.batches.split(",")[:3]), max(30, a.steps // 2),
                  False, a.device_pool)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    save()
    print(summary(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
