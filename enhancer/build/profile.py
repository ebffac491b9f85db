"""`enhancer bench --profile`: what the step graph is made of and where a step's time goes.

`node_counts` counts the nodes of a model that are not constants, inside subgraphs too (the step
graph's `If` holds a one-frame branch, the live step, and a many-frame branch, the offline call),
by operator. `profile` runs live steps (one frame per call) and offline calls (`OFFLINE_FRAMES`
per call) through a session with onnxruntime's profiler on, and sums its kernel times by operator:
per live step, and per 16 ms of audio offline. Every kernel is a call per step, so the node count
is what bounds a live step where the arithmetic does not (most of all on a GPU). It reads the
graph with `onnx` (the [train] extra).
"""
from __future__ import annotations

import collections
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from ..engine import Engine, LanePool, session_options
from ..runtime import OFFLINE_FRAMES

TOP = 15  # operators listed in the table
CONTROL_FLOW = ("If", "Loop", "Scan")  # their time is their subgraphs' kernels, each profiled on its own


def node_counts(path) -> dict:
    """{"total": non-constant nodes in all, "top": of the top-level graph, "branches": {name: nodes
    of each subgraph}, "by_op": {op: nodes}} of the model at `path`."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    by_op: collections.Counter = collections.Counter()
    branches: dict[str, int] = {}

    def walk(graph, counter) -> int:
        n = 0
        for node in graph.node:
            if node.op_type != "Constant":
                counter[node.op_type] += 1
                n += 1
            for attr in node.attribute:
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    inner: collections.Counter = collections.Counter()
                    branches[f"{node.name or node.op_type}.{attr.name}"] = walk(sub, inner)
                    counter.update(inner)
        return n

    top = walk(model.graph, by_op)
    return {"total": sum(by_op.values()), "top": top, "branches": branches, "by_op": dict(by_op.most_common())}


def _profiled(engine: Engine, prefix: str) -> Engine:
    """A copy of `engine` whose session profiles every kernel (files at `prefix`*)."""
    import onnxruntime as ort

    so = session_options()
    so.enable_profiling = True
    so.profile_file_prefix = prefix
    copy = Engine.__new__(Engine)
    copy.__dict__.update(engine.__dict__)
    copy.session = ort.InferenceSession(str(engine.path), so, providers=engine.session.get_providers())
    return copy


def kernel_times(profile_file) -> dict[str, float]:
    """Microseconds of kernel time by operator in an onnxruntime profile (its "Node" events; control
    flow nodes left out: the kernels of their subgraphs are counted instead)."""
    events = json.loads(Path(profile_file).read_text())
    out: collections.Counter = collections.Counter()
    for e in events:
        op = e.get("args", {}).get("op_name", "?")
        if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time") and op not in CONTROL_FLOW:
            out[op] += float(e.get("dur", 0))
    return dict(out)


def profile(engine: Engine, batch: int = 16, steps: int = 100, calls: int = 4, seed: int = 0) -> dict:
    """Kernel time by operator (ms): per live step of `batch` streams (the mean of `steps`), and per
    16 ms hop of offline calls of `OFFLINE_FRAMES` frames (`calls` of them, one stream)."""
    hop = engine.config.stft.hop
    rng = np.random.default_rng(seed)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, b, t, n in (("live", batch, 1, steps), ("offline", 1, OFFLINE_FRAMES, calls)):
            prof = _profiled(engine, os.path.join(tmp, name))
            pool = LanePool(prof, b)
            lanes = pool.alloc(b)
            gains = np.zeros(b, np.float32)
            for _ in range(n):
                pool.run(lanes, (0.05 * rng.standard_normal((b, t, hop))).astype(np.float32), gains)
            times = kernel_times(prof.session.end_profiling())
            per = n if name == "live" else n * t  # per live step; per hop offline
            ms = {op: us / 1000.0 / per for op, us in sorted(times.items(), key=lambda kv: -kv[1])}
            out[name] = {"batch": b, "frames_per_call": t, "calls": n, "ms_per_" + ("step" if name == "live" else "hop"): ms,
                         "total_ms": sum(ms.values())}
    return out


def report(engine: Engine, batch: int = 16, steps: int = 100) -> dict:
    return {"model": str(engine.path), "nodes": node_counts(engine.path), "kernels": profile(engine, batch, steps)}


def format_report(r: dict) -> str:
    nodes = r["nodes"]
    lines = [f"model: {r['model']} (kernel times with the profiler on: compare shares, not speeds; "
             "`enhancer bench` measures speed)",
             f"nodes (not constants): {nodes['total']} in all; top level {nodes['top']}; "
             + ", ".join(f"{k} {v}" for k, v in nodes["branches"].items()),
             "by operator: " + ", ".join(f"{op} {n}" for op, n in list(nodes["by_op"].items())[:TOP])]
    for name, k in r["kernels"].items():
        unit = "step" if name == "live" else "hop"
        ms = k[f"ms_per_{unit}"]
        total = k["total_ms"]
        head = (f"{name}: batch {k['batch']}, {k['frames_per_call']} frame(s) per call: kernel time "
                f"{total:.3f} ms per {unit}" + (f" ({total / k['batch']:.4f} ms per stream)" if name == "live" else ""))
        lines.append(head)
        for op, t in list(ms.items())[:TOP]:
            lines.append(f"  {op:<28} {t:9.4f} ms  {100 * t / total if total else 0:5.1f} %")
    return "\n".join(lines)
