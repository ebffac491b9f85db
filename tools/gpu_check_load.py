"""The GPU check's load-test stages (`tools.gpu_check`): servers on the device driven by load
generator processes (`tools.loadtest --json`), their results summed into one report entry.

- `load_test`: one server with a fixed capacity, at several levels of live streams;
- `load_test_servers`: several calibrated server processes sharing the device, each overloaded;
- `load_test_step_server`: one step server on the device and service processes stepping through it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from . import REPO_ROOT

FILE = REPO_ROOT / "tests" / "fixtures" / "golden" / "noisy.flac"  # the parity stage's signal; what the generators stream


def load_test(model: Path, device: str, levels: list[int], clients: int, seconds: float) -> dict:
    """One server on `device` with a fixed capacity of max(levels); for each level, `clients` load
    generator processes share the streams (the websocket clients of one Python process top out
    long before a GPU does)."""
    from .launch import start

    top = max(levels)
    t0 = time.perf_counter()
    srv = start(model, device=device, workers=1, max_streams=top, capacity=top)
    res = {"server_start_s": round(time.perf_counter() - t0, 1), "capacity": top, "levels": []}
    try:
        for n in levels:
            k = max(1, min(clients, n))
            share = [n // k + (i < n % k) for i in range(k)]
            parts = _generators([(srv, ["--streams", str(c)]) for c in share], seconds, slack_s=120.0)
            level = {"streams": n, "clients": k, "seconds": seconds,
                     "budget_ms": next((q["budget_ms"] for q in parts if "budget_ms" in q), None),
                     "errors": [e for q in parts for e in q.get("errors", [])][:10]
                     + [q["error"] for q in parts if "error" in q]} | _aggregate(parts)
            level["capacity"] = top  # one server: each generator reports its capacity, not a share of it
            res["levels"].append(level)
            print(f"load test: {n} streams: admitted {level['admitted']}, late {level['late']} of {level['messages']}, "
                  f"p50 {level['latency_p50_ms_median']} ms, worst p99 {level['latency_p99_ms_worst']} ms", flush=True)
    finally:
        srv.stop()
        res["server_log_tail"] = srv.log_tail(3000)
    return res


def load_test_servers(model: Path, device: str, servers: int, max_streams: int, offer: float, seconds: float,
                      batch_wait_ms: float, full_steps: bool = False) -> dict:
    """`servers` server processes sharing the device, each measuring its own capacity at start-up
    (at most `max_streams`), each offered `offer` x that capacity by a load generator process of
    its own: what one GPU serves when its host side (event loop, step set-up) is spread over
    processes, and whether the admitted streams are on time. `full_steps`: the servers' pools step
    the whole pool per live step, where the service's settings have that switch."""
    from .launch import ServerProcess

    t0 = time.perf_counter()
    procs = [ServerProcess(model, device=device, workers=1, max_streams=max_streams, max_batch_wait_ms=batch_wait_ms,
                           **_pool_settings(full_steps)) for _ in range(servers)]
    try:
        for srv in procs:
            srv.wait_ready(timeout=240)
        res = {"servers": servers, "max_streams": max_streams, "offer": offer, "seconds": seconds,
               "max_batch_wait_ms": batch_wait_ms, "start_s": round(time.perf_counter() - t0, 1)}
        parts = _generators([(srv, ["--overload", str(offer)]) for srv in procs], seconds)
    finally:
        for srv in procs:
            srv.stop()
    res.update(_aggregate(parts))
    print(f"load test, {servers} server(s): capacity {res['capacity']}, admitted {res['admitted']} of {res['offered']}, "
          f"late {res['late']} ({res['late_other']} apart from stalls) of {res['messages']}, p50 "
          f"{res['latency_p50_ms_median']} ms, worst p99 {res['latency_p99_ms_worst']} ms", flush=True)
    return res


def _generators(jobs: list, seconds: float, slack_s: float = 180.0) -> list[dict]:
    """Load generator processes at once, one per (server process, arguments: how many streams) of
    `jobs`; their JSON results, or {"error": ...} for one that gave none."""
    gens = [subprocess.Popen([sys.executable, "-m", "tools.loadtest", "--url", srv.ws_url, "--server-pid",
                              str(srv.pid), *args, "--seconds", str(seconds), "--file", str(FILE), "--json"],
                             cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for srv, args in jobs]
    parts = []
    for g in gens:
        out, err = g.communicate(timeout=seconds + slack_s)
        line = next((x for x in reversed(out.splitlines()) if x.startswith("{")), None)
        parts.append(json.loads(line) if line else {"error": err.strip()[-1500:], "rc": g.returncode})
    return parts


def _aggregate(parts: list[dict]) -> dict:
    good = [q for q in parts if "admitted" in q]
    return {
        "per_process": [{k: q.get(k) for k in ("capacity", "offered", "admitted", "refused", "refused_1013_with_capacity",
                                               "messages", "late",
                                               "late_other", "latency_p50_ms", "latency_p99_ms", "latency_max_ms",
                                               "server_cpu_pct", "client_cpu_pct", "mean_batch", "mean_step_ms",
                                               "server_late_hops", "complete", "healthy", "error")} for q in parts],
        "capacity": sum(q.get("capacity") or 0 for q in good), "offered": sum(q["offered"] for q in good),
        "admitted": sum(q["admitted"] for q in good), "refused": sum(q["refused"] for q in good),
        "messages": sum(q["messages"] for q in good), "late": sum(q["late"] for q in good),
        "late_other": sum(q.get("late_other", 0) for q in good),
        "latency_p50_ms_median": float(np.median([q["latency_p50_ms"] for q in good if q["latency_p50_ms"]])) if good else None,
        "latency_p99_ms_worst": max((q["latency_p99_ms"] or 0 for q in good), default=None),
        "ok": len(good) == len(parts) and all(q.get("complete") and q.get("healthy") for q in good),
    }


def _pool_settings(full_steps: bool) -> dict:
    """The service settings that switch its pools to full-pool live steps."""
    return {"full_steps": True} if full_steps else {}


def load_test_step_server(model: Path, device: str, fronts: int, per_front: int, seconds: float, batch_wait_ms: float,
                          lanes: int = 1024, full_steps: bool = False) -> dict:
    """One step server on `device` (the model, every stream's state; with `full_steps`, full-pool
    live steps) and `fronts` service processes stepping through it (`enhancer serve --step-server`),
    each admitting `per_front` live streams (a fixed capacity) and driven by a load generator
    process of its own."""
    import secrets
    import tempfile

    from .launch import ServerProcess

    address = tempfile.mktemp(prefix="tim-step-", suffix=".sock")
    key = secrets.token_hex(32)  # the key the step server and its front-ends share
    key_fd, key_file = tempfile.mkstemp(prefix="tim-step-", suffix=".key")
    with os.fdopen(key_fd, "w") as f:
        f.write(key)
    log_path = Path(tempfile.mkstemp(prefix="tim-step-", suffix=".log")[1])
    t0 = time.perf_counter()
    with open(log_path, "wb") as log_file:
        step = subprocess.Popen([sys.executable, "-m", "server.stepserver", "--address", address, "--device", device,
                                 "--lanes", str(lanes), "--model", str(model), "--key-file", key_file,
                                 *(["--full-steps"] if full_steps else [])], cwd=REPO_ROOT,
                                stdout=subprocess.DEVNULL, stderr=log_file)
    procs: list = []
    res: dict = {"fronts": fronts, "per_front": per_front, "seconds": seconds, "max_batch_wait_ms": batch_wait_ms,
                 "lanes": lanes}
    try:
        deadline = time.time() + 180
        while not Path(address).exists():
            if step.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"step server did not start: {log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)
        procs = [ServerProcess(model, device="cpu", workers=1, max_streams=per_front, capacity=per_front,
                               step_server=address, step_key=key, max_batch_wait_ms=batch_wait_ms) for _ in range(fronts)]
        for srv in procs:
            srv.wait_ready(timeout=240)
        res["start_s"] = round(time.perf_counter() - t0, 1)
        res.update(_aggregate(_generators([(srv, ["--streams", str(per_front)]) for srv in procs], seconds)))
    finally:
        for srv in procs:
            srv.stop()
        step.terminate()
        try:
            step.wait(timeout=20)
        except subprocess.TimeoutExpired:
            step.kill()
        res["step_server_log_tail"] = log_path.read_text(errors="replace")[-1500:]
        Path(key_file).unlink(missing_ok=True)
    print(f"step server + {fronts} x {per_front}: admitted {res.get('admitted')}, late {res.get('late')} "
          f"({res.get('late_other')} apart from stalls) of {res.get('messages')}, p50 {res.get('latency_p50_ms_median')} ms, "
          f"worst p99 {res.get('latency_p99_ms_worst')} ms", flush=True)
    return res
