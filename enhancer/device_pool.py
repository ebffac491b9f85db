"""`DeviceLanePool`: a `LanePool` whose per-stream caches live where the session computes (GPU
memory under CUDA), with onnxruntime I/O binding.

A `LanePool` keeps every stream's state and key/value rings in numpy arrays: each call sends the
rings of the lanes it steps to the session and takes the new rows back. On the CPU that costs
nothing; under CUDA it would move the rings (megabytes per stream) across the bus on every 16 ms
step. Here the caches are device buffers that the step graph reads in place (bound by address: a
lane range is a pointer and a shape), its updated states and new key/value rows stay on the device,
and one small graph per step (`enhancer.lane_graphs`) writes them into the pool there. Per call only the
hops, gain floors and positions go in and the enhanced hops, activity and competition come out.

With `full_steps`, a live step (one frame) runs over the whole pool through a session of the step
graph with static shapes, every buffer bound once, replayed as a CUDA graph under CUDA (`_FullStep`):
the step is bound by kernel launches, not by the batch, and a replay is one launch.

`export_lanes` and `import_lanes` (a stream handed to another process) copy only the lanes asked
for, cache by cache (the gather_rows and scatter_rows graphs: the device rows to or from host arrays).

Same interface (`enhancer.pools.LanePoolProtocol`), same results as `LanePool` (tests/enhancer/test_device_pool.py steps both through
the same calls on the CPU; `tools/gpu_check.py` does it under CUDA). Float key/value rings
only: int8 rings (`enhancer.build.ringquant`) exist to save CPU memory bandwidth and stay on `LanePool`.
`make_pool` picks the pool for an engine.
"""
from __future__ import annotations

import logging
from math import prod

import numpy as np

from .engine import Engine, LanePool, Lanes, StepResult, lane_range
from .errors import CheckpointError
from .pools import LanePoolProtocol, check_lane_arrays
from .step_io import NEXT, ring_specs, state_specs

DEVICES_BY_PROVIDER = {"CUDAExecutionProvider": "cuda", "CPUExecutionProvider": "cpu"}
HOST_OUTPUTS = ("out", "competition", "activity")  # outputs that come back to the host each call
log = logging.getLogger("tim_enhancer")
ZERO_CHUNK_BYTES = 256 << 20  # a reset zeroes at most this many bytes of rings per graph call
COPY_CHUNK_BYTES = 64 << 20  # an export or import copies at most this many bytes of one cache per graph call


def engine_device(engine: Engine) -> str:
    """onnxruntime's device name ("cuda" or "cpu") for the provider the engine's session runs on."""
    return DEVICES_BY_PROVIDER.get(engine.provider, "cpu")


def make_pool(engine: Engine, capacity: int, full_steps: bool | None = False,
              device_pool: bool = False) -> LanePoolProtocol:
    """The lane pool for `engine`: on a CUDA session with float rings a `DeviceLanePool` (the caches
    stay on the GPU), else a `LanePool` (numpy caches). `device_pool`: the device pool on the CPU
    provider too (a rehearsal of the GPU's code path; slower than `LanePool` there). `full_steps`:
    live steps of the whole pool through a static graph, captured as a CUDA graph under CUDA
    (`DeviceLanePool`; None is False). Both are switches of the caller's (`enhancer bench
    --full-steps --device-pool`, the service's settings); nothing here reads the environment."""
    if uses_device_pool(engine, device_pool):
        return DeviceLanePool(engine, capacity, full_steps=bool(full_steps))
    return LanePool(engine, capacity)


def uses_device_pool(engine: Engine, device_pool: bool = False) -> bool:
    """Whether `make_pool(engine, ..., device_pool=device_pool)` keeps this engine's streams in a
    `DeviceLanePool` (on the device)."""
    wanted = engine_device(engine) == "cuda" or device_pool
    return wanted and not engine.int8_rings


class _LaneGraphs:
    """The sessions of the lane graphs on an engine's device (one set per engine, shared by its pools)."""

    def __init__(self, engine: Engine):
        import onnxruntime as ort

        from . import lane_graphs

        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        providers = engine.session.get_providers()
        self.sessions = {name: ort.InferenceSession(str(lane_graphs.path(name)), so, providers=providers)
                         for name in lane_graphs.NAMES}

    @classmethod
    def of(cls, engine: Engine) -> _LaneGraphs:
        graphs = getattr(engine, "_lane_graphs", None)
        if graphs is None:
            graphs = engine._lane_graphs = cls(engine)
        return graphs


class _FullStep:
    """The live step of a whole pool: a session of the step graph with its batch fixed at the pool's
    capacity and one frame per call (onnxruntime then folds the graph's shape arithmetic and its
    T = 1 branch into one static graph), every input and output bound once to device buffers of
    its own or to the pool's. Under CUDA it runs as a CUDA graph (`enable_cuda_graph`): one launch
    replays the step's thousand kernels, which is what a live step costs otherwise (it is bound by
    launches, not by the batch). Each call steps every lane; the lane writer keeps only the lanes
    that step."""

    def __init__(self, pool: DeviceLanePool):
        import onnxruntime as ort

        from .engine import CUDA_OPTIONS, session_options

        eng, c = pool.engine, pool.capacity
        so = session_options()
        so.add_free_dimension_override_by_name("batch", c)
        so.add_free_dimension_override_by_name("frames", 1)
        cuda = pool.device == "cuda"
        providers = [("CUDAExecutionProvider", CUDA_OPTIONS | {"enable_cuda_graph": "1"})] if cuda else \
            ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(eng.path), so, providers=providers)
        self.cuda_graph = cuda
        alloc = ort.OrtValue.ortvalue_from_numpy
        hop = eng.config.stft.hop
        self.hops = alloc(np.zeros((c, 1, hop), np.float32), pool.device, 0)
        self.gain = alloc(np.zeros(c, np.float32), pool.device, 0)
        self.pos = alloc(np.zeros(c, np.int64), pool.device, 0)
        self.io = self.session.io_binding()
        self.io.bind_ortvalue_input("hops", self.hops)
        self.io.bind_ortvalue_input("min_gain", self.gain)
        self.io.bind_ortvalue_input("pos", self.pos)
        pool._bind_caches(self.io, 0, c)
        # fixed output buffers (one frame per lane); the updated states go to the pool's `nexts`
        cfg = eng.config
        shapes = {"out": (c, 1, hop), "activity": (c, 1),
                  "kv_rows": (c, cfg.n_heads, 2 * cfg.n_layers, cfg.head_dim),
                  "competition": (c, 1, cfg.n_tim_layers, cfg.n_mechanisms)}
        self.outputs = {n: ort.OrtValue.ortvalue_from_shape_and_type(shapes[n], np.float32, pool.device, 0)
                        for n in eng.output_names if not n.endswith(NEXT)}
        pool._bind_outputs(self.io, c, fixed=self.outputs)

    def run(self, hops: np.ndarray, gain: np.ndarray, pos: np.ndarray) -> dict:
        """One live step of every lane: hops (C, 1, hop), gain (C,), pos (C,); the outputs' buffers."""
        self.hops.update_inplace(hops)
        self.gain.update_inplace(gain)
        self.pos.update_inplace(pos)
        self.session.run_with_iobinding(self.io)
        return self.outputs


class DeviceLanePool(Lanes):
    """Batched per-stream state on the session's device: `capacity` lanes, each one channel of one
    stream (the interface of `LanePool`). `full_steps`: live steps (one frame) run over the whole
    pool through `_FullStep` (a CUDA graph under CUDA); multi-frame calls as before."""

    def __init__(self, engine: Engine, capacity: int, full_steps: bool = False):
        import onnxruntime as ort

        if engine.int8_rings:
            raise CheckpointError(f"{engine.path}: int8 key/value rings stay on the host (LanePool); "
                                  "a device pool needs a model with float rings")
        self.engine, self.capacity = engine, int(capacity)
        self.device = engine_device(engine)
        self.graphs = _LaneGraphs.of(engine)
        cfg = engine.config
        self.states = [(name, shape, prod(shape)) for name, shape in state_specs(cfg)]
        self.rings_shape = (len(ring_specs(cfg)), self.capacity) + ring_specs(cfg)[0][1]  # (2N, C, H, W, dh)
        self.ring_names = [name for name, _ in ring_specs(cfg)]
        self._ring_lane = prod(self.rings_shape[2:])  # floats per lane in one ring
        alloc = ort.OrtValue.ortvalue_from_shape_and_type
        # every state in one flat buffer, state after state, each (capacity, L_j) (`lane_graphs`: lane_writer);
        # the step's updated states land in `nexts` the same way, each (lanes of the call, L_j)
        sizes = [n for _, _, n in self.states]
        self._cum = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)  # floats of the states before
        self._row = int(sum(sizes))  # floats of one lane's states
        self.state_buffer = alloc((self.capacity * self._row,), np.float32, self.device, 0)
        self.nexts = alloc((self.capacity * self._row,), np.float32, self.device, 0)
        self._templates = {
            "cum": np.concatenate([np.full(n, c, np.int64) for n, c in zip(sizes, self._cum)]),
            "size": np.concatenate([np.full(n, n, np.int64) for n in sizes]),
            "at": np.concatenate([np.arange(n, dtype=np.int64) for n in sizes])}
        self._templates = {k: ort.OrtValue.ortvalue_from_numpy(v, self.device, 0) for k, v in self._templates.items()}
        self.ring_buffer = alloc(self.rings_shape, np.float32, self.device, 0)
        self.pos = np.zeros(self.capacity, dtype=np.int64)
        self._init_lanes()
        self._zero(np.arange(self.capacity, dtype=np.int64))  # device memory comes uninitialised
        self.full_step, self.full_step_error = None, None
        if full_steps:
            try:
                self.full_step = _FullStep(self)
            except Exception as e:  # e.g. a node CUDA graphs cannot hold: live steps as without full_steps
                self.full_step_error = f"{type(e).__name__}: {e}"
                log.warning("full-pool live steps unavailable (%s); stepping lane ranges", self.full_step_error)

    def reset(self, lanes: np.ndarray) -> None:
        self._zero(np.asarray(lanes, dtype=np.int64))
        self.pos[lanes] = 0

    # a stream's state to and from the host (`LanePoolProtocol.export_lanes`, `import_lanes`)
    def export_lanes(self, lanes: np.ndarray) -> dict[str, np.ndarray]:
        """The state of `lanes` on the host: only their rows cross the bus, one gather_rows call per
        cache (and per COPY_CHUNK_BYTES of it), each written straight into the host array."""
        lanes = self._lanes_of(lanes)
        k, sess = len(lanes), self.graphs.sessions["gather_rows"]
        out = {"pos": self.pos[lanes]}
        for name, shape, n, ptr in self._blocks():
            rows = np.empty((k, n), np.float32)
            for part in self._chunks(n, k):
                io = sess.io_binding()
                self._bind_in(io, "data", (1, self.capacity, n), ptr)
                io.bind_cpu_input("lanes", lanes[part])
                io.bind_output("rows", "cpu", 0, np.float32, [1, part.stop - part.start, n], rows[part].ctypes.data)
                sess.run_with_iobinding(io)
            out[name] = rows.reshape((k,) + shape)
        return out

    def import_lanes(self, lanes: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        """Set the state of `lanes` (distinct) from `export_lanes`' arrays, one scatter_rows call per
        cache (and per COPY_CHUNK_BYTES of it), in place; ValueError, and nothing changed, when
        the lanes or an array's name, shape or dtype are not the pool's."""
        lanes = self._lanes_of(lanes, distinct=True)
        arrays = check_lane_arrays(self.engine, len(lanes), arrays)
        k, sess = len(lanes), self.graphs.sessions["scatter_rows"]
        for name, _, n, ptr in self._blocks():
            rows = np.ascontiguousarray(arrays[name]).reshape(1, k, n)
            for part in self._chunks(n, k):
                io = sess.io_binding()
                self._bind_in(io, "data", (1, self.capacity, n), ptr)
                io.bind_cpu_input("lanes", lanes[part])
                io.bind_cpu_input("rows", np.ascontiguousarray(rows[:, part]))
                self._bind_out(io, "out", (1, self.capacity, n), ptr)
                sess.run_with_iobinding(io)
        self.pos[lanes] = arrays["pos"]

    def _lanes_of(self, lanes, distinct: bool = False) -> np.ndarray:
        """`lanes` as (k,) int64, checked: lanes of this pool (ValueError else), each once if `distinct`."""
        a = np.asarray(lanes)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise ValueError(f"lanes must be (k,) integers, got {a.dtype}{list(a.shape)}")
        a = a.astype(np.int64)
        if a.size and (a.min() < 0 or a.max() >= self.capacity):
            raise ValueError(f"lanes must be in [0, {self.capacity}), got {a.min()}..{a.max()}")
        if distinct and len(np.unique(a)) != len(a):
            raise ValueError("lanes repeat")
        return a

    def _blocks(self) -> list[tuple[str, tuple, int, int]]:
        """Every cache as (name, per-lane shape, floats per lane, device address of its (capacity,
        floats per lane) rows): the states, then the rings."""
        states, rings = self.state_buffer.data_ptr(), self.ring_buffer.data_ptr()
        out = [(name, shape, n, states + 4 * self.capacity * int(cum))
               for (name, shape, n), cum in zip(self.states, self._cum)]
        ring_bytes = 4 * self.capacity * self._ring_lane
        return out + [(name, self.rings_shape[2:], self._ring_lane, rings + j * ring_bytes)
                      for j, name in enumerate(self.ring_names)]

    @staticmethod
    def _chunks(n: int, k: int) -> list[slice]:
        """k lanes of n floats each in parts of at most COPY_CHUNK_BYTES (one lane at least)."""
        per = max(1, COPY_CHUNK_BYTES // (4 * n))
        return [slice(i, min(i + per, k)) for i in range(0, k, per)]

    # device updates
    def _bind_in(self, io, name: str, shape, ptr: int, dtype=np.float32) -> None:
        io.bind_input(name, self.device, 0, dtype, list(shape), ptr)

    def _bind_out(self, io, name: str, shape, ptr: int) -> None:
        io.bind_output(name, self.device, 0, np.float32, list(shape), ptr)

    def _zero_rows(self, data_shape, data_ptr: int, lanes: np.ndarray) -> None:
        """The zero_rows graph on (M, C, L) device memory at `data_ptr`, in place."""
        sess = self.graphs.sessions["zero_rows"]
        io = sess.io_binding()
        self._bind_in(io, "data", data_shape, data_ptr)
        io.bind_cpu_input("lanes", lanes)
        self._bind_out(io, "out", data_shape, data_ptr)
        sess.run_with_iobinding(io)

    def _zero(self, lanes: np.ndarray) -> None:
        if lanes.size == 0:
            return
        base = self.state_buffer.data_ptr()
        for (_, _, n), cum in zip(self.states, self._cum):
            self._zero_rows((1, self.capacity, n), base + 4 * self.capacity * int(cum), lanes)
        m = self.rings_shape[0]
        per_call = max(1, ZERO_CHUNK_BYTES // (4 * m * self._ring_lane))
        for i in range(0, lanes.size, per_call):
            self._zero_rows((m, self.capacity, self._ring_lane), self.ring_buffer.data_ptr(), lanes[i:i + per_call])

    def _bind_caches(self, io, lo: int, hi: int) -> None:
        """The states and rings of lanes [lo, hi) as the step's inputs, in place."""
        b, states = hi - lo, self.state_buffer.data_ptr()
        for (name, shape, n), cum in zip(self.states, self._cum):
            self._bind_in(io, name, (b,) + shape, states + 4 * (self.capacity * int(cum) + lo * n))
        ring_base, ring_bytes = self.ring_buffer.data_ptr(), 4 * self.capacity * self._ring_lane
        for j, name in enumerate(self.ring_names):
            self._bind_in(io, name, (b,) + self.rings_shape[2:], ring_base + j * ring_bytes + 4 * lo * self._ring_lane)

    def _bind_outputs(self, io, b: int, fixed: dict | None = None) -> list[str]:
        """The step's outputs of a call over `b` lanes, bound in the graph's order (the order of
        `io.get_outputs()`, returned): the updated states straight into `nexts`, where the lane
        writer reads them; the others into `fixed` buffers when given, else where onnxruntime puts
        them (`HOST_OUTPUTS` on the host, the rest on the device)."""
        nexts = self.nexts.data_ptr()
        where = {name + NEXT: (shape, cum) for (name, shape, _), cum in zip(self.states, self._cum)}
        for name in self.engine.output_names:
            if name in where:
                shape, cum = where[name]
                self._bind_out(io, name, (b,) + shape, nexts + 4 * b * int(cum))
            elif fixed is not None:
                io.bind_ortvalue_output(name, fixed[name])
            else:
                io.bind_output(name, "cpu" if name in HOST_OUTPUTS else self.device)
        return list(self.engine.output_names)

    def _write(self, kv, sel: np.ndarray, lanes: np.ndarray, slots: np.ndarray, b: int) -> None:
        """One lane-writer call: the new key/value rows into the rings, rows `sel` of the updated
        states (in `nexts`, `b` rows each) into lanes `lanes`, in place."""
        sess = self.graphs.sessions["lane_writer"]
        io = sess.io_binding()
        ring_base, states = self.ring_buffer.data_ptr(), self.state_buffer.data_ptr()
        self._bind_in(io, "rings", self.rings_shape, ring_base)
        self._bind_in(io, "kv_rows", kv.shape(), kv.data_ptr())
        self._bind_in(io, "states", (self.capacity * self._row,), states)
        self._bind_in(io, "nexts", (b * self._row,), self.nexts.data_ptr())
        for name, value in self._templates.items():
            io.bind_ortvalue_input(name, value)
        io.bind_cpu_input("sel", sel)
        io.bind_cpu_input("lanes", lanes)
        io.bind_cpu_input("slots", slots)
        io.bind_cpu_input("K", np.array([b], np.int64))
        io.bind_cpu_input("C", np.array([self.capacity], np.int64))
        self._bind_out(io, "rings_out", self.rings_shape, ring_base)
        self._bind_out(io, "states_out", (self.capacity * self._row,), states)
        sess.run_with_iobinding(io)

    def _run_full(self, lanes: np.ndarray, hops: np.ndarray, min_gain: np.ndarray) -> StepResult:
        c, window = self.capacity, self.engine.config.attention_window
        h = np.zeros((c, 1, hops.shape[2]), np.float32)
        g = np.zeros(c, np.float32)
        h[lanes], g[lanes] = hops, min_gain
        outs = self.full_step.run(h, g, self.pos.copy())
        slots = (self.pos[lanes] % window)[:, None].astype(np.int64)
        self._write(outs["kv_rows"], lanes, lanes, slots, c)
        self.pos[lanes] += 1
        host = {name: outs[name].numpy() for name in HOST_OUTPUTS if name in outs}
        comp = host["competition"][lanes] if "competition" in host else None
        return StepResult(out=host["out"][lanes], competition=comp, activity=host["activity"][lanes])

    def run(self, lanes: np.ndarray, hops: np.ndarray, min_gain: np.ndarray) -> StepResult:
        """Advance `lanes` (distinct) by T hops each in one call: hops (k, T, hop) -> out (k, T, hop),
        as `LanePool.run`: the call covers the lane range [min, max]; lanes in it that are not
        stepping are computed but left untouched."""
        eng = self.engine
        lanes = np.asarray(lanes, dtype=np.int64)
        if self.full_step is not None and hops.shape[1] == 1:
            return self._run_full(lanes, hops, min_gain)
        lo, hi, idx, _, h, g = lane_range(lanes, hops, min_gain)
        b, t = hi - lo, hops.shape[1]
        io = eng.session.io_binding()
        io.bind_cpu_input("hops", h)
        io.bind_cpu_input("min_gain", g)
        io.bind_cpu_input("pos", self.pos[lo:hi].copy())
        self._bind_caches(io, lo, hi)
        names = self._bind_outputs(io, b)
        eng.session.run_with_iobinding(io)
        outs = dict(zip(names, io.get_outputs()))
        sel = idx.astype(np.int64)
        window = eng.config.attention_window
        s = min(t, window)
        pos = self.pos[lanes]
        slots = ((pos[:, None] + (t - s) + np.arange(s)[None, :]) % window).astype(np.int64)
        kv = outs["kv_rows"]
        self._write(kv, sel, lanes, slots, b)
        self.pos[lanes] += t
        out = outs["out"].numpy()[sel]
        comp = outs["competition"].numpy()[sel] if "competition" in outs else None
        return StepResult(out=out, competition=comp, activity=outs["activity"].numpy()[sel])
