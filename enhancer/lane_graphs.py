"""Small ONNX graphs that update a `DeviceLanePool`'s caches where they live (on the GPU with
CUDA), so that between steps only the 16 ms hops and their outputs cross the bus, and that copy
the caches of a few lanes to and from the host:

- `lane_writer`, once per step: the new key/value rows into the rings (rings (M, C, H, W, D),
  kv_rows (K, H, M * T, D): the last S of the T new rows of step row sel[i] at lane lanes[i], slots
  slots[i], as `enhancer.step_io.write_rings` does on the host) and the updated states into the
  state buffer (every state in one flat buffer, see the graph's comments), for all k stepped lanes;
- `zero_rows`: data (M, C, L), lanes (k,) -> data with rows `lanes` zeroed (a lane's reset);
- `gather_rows`: data (M, C, L), lanes (k,) -> rows (M, k, L), the rows `lanes` of each block
  (`export_lanes`: the output is bound on the host, so only those rows cross the bus);
- `scatter_rows`: data (M, C, L), lanes (k,), rows (M, k, L) -> data with rows `lanes` set to
  `rows` (`import_lanes`: the rows come from the host).

Each but `gather_rows` is a scatter (ScatterND, ScatterElements) whose outputs the pool binds to
its inputs' memory: the update happens in place. The graphs hold no weights and every dimension is
read from the inputs, so one file of each serves every model. They are built with `onnx`
(`enhancer.build.lane_graphs.build()`, a development dependency; `python -m enhancer.build.lane_graphs`
writes them) and shipped as files in enhancer/graphs/; `tests/enhancer/test_device_pool.py` checks
that the files are what `build()` writes.
"""
from __future__ import annotations

from pathlib import Path

GRAPHS_DIR = Path(__file__).resolve().parent / "graphs"  # package data: enhancer.graphs
NAMES = ("lane_writer", "zero_rows", "gather_rows", "scatter_rows")
OPSET = 17


def path(name: str) -> Path:
    if name not in NAMES:
        raise ValueError(f"no lane graph {name!r}; one of {', '.join(NAMES)}")
    return GRAPHS_DIR / f"{name}.onnx"
