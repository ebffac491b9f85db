"""REST throughput: post one file to /v1/enhance several times, report the server's CPU and wall time per request.

    python -m tools.restbench --seconds 60 --repeat 3 [--workers 1] [--threads 1] [--model PATH]
    python -m tools.restbench --url http://HOST:PORT --server-pid PID   # a server already running

The file is the dev set's noisy files (or --file) repeated to --seconds, as 16-bit WAV. Without --url it
starts a server itself (fixed capacity, so no start-up calibration runs). Each request is checked: status
200 and as many frames back as were sent.
"""
from __future__ import annotations

import argparse
import io
import json
import sys
import time

import numpy as np

from .loadtest import ProcStats, load_audio, model_path


def wav_bytes(audio: np.ndarray, rate: int) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, audio, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def measure(base: str, body: bytes, frames: int, repeat: int, pid: int | None) -> list[dict]:
    import httpx

    stats = ProcStats(pid)
    rows = []
    with httpx.Client(timeout=600) as client:
        for _ in range(repeat):
            cpu0, t0 = stats.cpu_seconds(), time.perf_counter()
            r = client.post(base + "/v1/enhance", content=body, headers={"Content-Type": "audio/wav"})
            wall = time.perf_counter() - t0
            cpu = stats.cpu_seconds() - cpu0
            if r.status_code != 200:
                raise SystemExit(f"POST /v1/enhance answered {r.status_code}: {r.text[:300]}")
            got = int(r.headers.get("X-Frames", -1))
            if got != frames:
                raise SystemExit(f"sent {frames} frames, the answer says {got}")
            rows.append({"wall_s": round(wall, 3), "server_cpu_s": round(cpu, 3)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.restbench", description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="length of the posted file")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--url", help="base URL of a running server (default: start one)")
    p.add_argument("--server-pid", type=int, help="PID of the server at --url, for its CPU time")
    p.add_argument("--model", help="model for the started server (default: shipped, else random-weight tim)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="onnxruntime threads per worker")
    p.add_argument("--file", help="audio to post (default: the dev set's noisy files)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    audio, rate = load_audio(args.file, None)
    n = int(args.seconds * rate)
    audio = np.resize(audio, n)  # repeated to the length asked for
    body = wav_bytes(audio, rate)
    proc, base, pid = None, args.url, args.server_pid
    if base is None:
        from .launch import start

        proc = start(model_path(args.model), device="cpu", workers=args.workers, threads=args.threads,
                     max_streams=1, capacity=1)
        base, pid = proc.base, proc.pid
    try:
        rows = measure(base.rstrip("/"), body, n, args.repeat, pid)
    finally:
        if proc is not None:
            proc.stop()
    result = {"seconds": n / rate, "sample_rate": rate, "requests": rows,
              "server_cpu_s_median": float(np.median([r["server_cpu_s"] for r in rows])),
              "wall_s_median": float(np.median([r["wall_s"] for r in rows]))}
    if args.json:
        print(json.dumps(result))
    else:
        for i, r in enumerate(rows, 1):
            print(f"request {i}: {result['seconds']:g} s of audio, wall {r['wall_s']:.2f} s, "
                  f"server CPU {r['server_cpu_s']:.2f} s")
        print(f"median: wall {result['wall_s_median']:.2f} s (real-time factor "
              f"{result['wall_s_median'] / result['seconds']:.3f}), server CPU {result['server_cpu_s_median']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
