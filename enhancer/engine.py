"""The step graph on onnxruntime: `Engine` (one session, its config read from the model's
metadata) and `LanePool` (batched per-stream state in which each stream channel owns a lane; one
call steps any set of lanes by one hop, `step`, or by T hops, `run`). Never imports torch.
"""
from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .devices import PROVIDERS
from .errors import AudioError, CheckpointError
from .step_io import (
    RING_FORMATS,
    STEP_FORMAT,
    StepOutputs,
    cache_specs,
    check_lane_arrays,
    init_rings,
    init_states,
    input_names,
    output_names,
    ring_views,
    write_rings,
)
from .upperhead import WEIGHTS as HEAD_WEIGHTS
from .upperhead import UpperHead

# Under CUDA: float32 matrix products in float32 (not TF32), so that the GPU's output matches the CPU's
# within the export's tolerance; the live step is bound by kernel launches, not arithmetic.
CUDA_OPTIONS = {"use_tf32": "0"}


# The CUDA 13 libraries onnxruntime-gpu's CUDA provider links (in load order: a library after those it
# needs), and optional ones it opens when a graph needs them.
CUDA_LIBRARIES = ("libcudart.so.13", "libcublasLt.so.13", "libcublas.so.13", "libcurand.so.10")
CUDA_OPTIONAL = ("libcufft.so.12", "libnvrtc.so.13", "libcudnn.so.9")


def _nvidia_library(name: str) -> str | None:
    """Where an nvidia-* Python package holds the library `name` (nvidia/cu13/lib/ from CUDA 13 on,
    nvidia/<component>/lib/ before), on any entry of sys.path; None if none does."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(glob.glob(f"{root}/*/lib/{name}"))
        if found:
            return found[0]
    return None


@functools.cache
def preload_cuda_libraries() -> bool:
    """Load the CUDA libraries that onnxruntime-gpu's CUDA provider links from the nvidia-* Python
    packages (the [gpu] extra's, or a PyTorch install's), so that it runs without a system CUDA and
    wherever onnxruntime itself is installed; then onnxruntime's own `preload_dlls`. Once per
    process. True when every required library was found in those packages (else the system's
    libraries may still serve: the session then says whether CUDA started)."""
    import contextlib
    import ctypes
    import io

    import onnxruntime as ort

    found = 0
    for name in CUDA_LIBRARIES + CUDA_OPTIONAL:
        path = _nvidia_library(name)
        if path is None:
            continue
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            found += name in CUDA_LIBRARIES
        except OSError:
            pass
    if hasattr(ort, "preload_dlls"):  # onnxruntime >= 1.21; it prints what it cannot load: keep stdout clean
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                ort.preload_dlls()
            except Exception:  # nothing more to load that way
                pass
    return found == len(CUDA_LIBRARIES)


def min_gain_for(atten_lim_db: float | None) -> float:
    """Gain floor for an attenuation limit in dB (None or inf = no limit)."""
    if atten_lim_db is None:
        return 0.0
    try:
        db = float(atten_lim_db)
    except (TypeError, ValueError):
        raise AudioError(f"atten_lim_db must be a number of dB, got {atten_lim_db!r}") from None
    if np.isnan(db) or db < 0:
        raise AudioError(f"atten_lim_db must be >= 0 dB, got {atten_lim_db!r}")
    return 0.0 if np.isinf(db) else float(10.0 ** (-db / 20.0))


@dataclass
class StepResult:
    """One call's result for k lanes: (k, ...) for `LanePool.step`, (k, T, ...) for `LanePool.run`."""

    out: np.ndarray  # (k, [T,] hop)
    competition: np.ndarray | None  # (k, [T,] n_tim, n_s)
    activity: np.ndarray  # (k, [T])


def load_upper_head(model_path: Path) -> UpperHead | None:
    """The upper band's learned head of the model at `model_path`: `upperband.npz` beside it (the
    shipped model has one); None (the per-band Wiener gains alone) when there is none."""
    path = Path(model_path).parent / HEAD_WEIGHTS
    return UpperHead.load(path) if path.is_file() else None


def session_options(threads: int = 1):
    """onnxruntime's options for a session of a step graph: `threads` intra-op threads, one inter-op,
    sequential, every graph optimization, warnings and errors only."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return so


class Engine:
    """One onnxruntime session of a step graph, with the config read from the model's metadata."""

    def __init__(self, path, providers=None, threads: int = 1):
        import onnxruntime as ort

        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"model file not found: {path}")
        so = session_options(threads)
        if providers is None:  # "auto"
            avail = ort.get_available_providers()
            providers = [p for p in PROVIDERS["cuda"] if p in avail]
        if "CUDAExecutionProvider" in providers:
            preload_cuda_libraries()
        providers = [(p, CUDA_OPTIONS) if p == "CUDAExecutionProvider" else p for p in providers]
        try:
            self.session = ort.InferenceSession(str(path), so, providers=providers)
        except Exception as e:  # onnxruntime raises several unrelated types
            raise CheckpointError(f"{path}: cannot load model ({type(e).__name__}: {e})") from None
        meta = self.session.get_modelmeta().custom_metadata_map
        if "tim_enhancer.config" not in meta:
            raise CheckpointError(f"{path}: not a tim-enhancer step graph (no tim_enhancer.config metadata)")
        if meta.get("tim_enhancer.step_format") != STEP_FORMAT:
            raise CheckpointError(f"{path}: step graph format {meta.get('tim_enhancer.step_format', '1')!r}, this runtime "
                                  f"needs {STEP_FORMAT!r}; re-export it from its checkpoint with `enhancer export CKPT -o MODEL`")
        self.path = path
        self.upper_head = load_upper_head(path)
        self.config = ModelConfig.from_dict(json.loads(meta["tim_enhancer.config"]))
        self.metadata = {k.split(".", 1)[1]: v for k, v in meta.items() if k.startswith("tim_enhancer.")}
        got_in = [i.name for i in self.session.get_inputs()]
        got_out = [o.name for o in self.session.get_outputs()]
        if got_in != input_names(self.config) or sorted(got_out) != sorted(output_names(self.config)):
            raise CheckpointError(f"{path}: graph inputs/outputs do not match its config {self.config.name!r}")
        self.input_names, self.output_names = got_in, got_out
        self.ring_format = self.metadata.get("rings", "float32")
        if self.ring_format not in RING_FORMATS:
            raise CheckpointError(f"{path}: key/value rings stored as {self.ring_format!r}; this runtime reads "
                                  f"{' or '.join(RING_FORMATS)}")

    @property
    def provider(self) -> str:
        """The execution provider really in use (first of the session's list)."""
        return self.session.get_providers()[0]

    @property
    def parameters(self) -> int:
        return int(self.metadata.get("parameters", 0))

    @property
    def weights(self) -> str:
        """How the weights are stored: fp32, fp16 (computed in float32) or int8 (8-bit dense layers)."""
        return self.metadata.get("weights", "fp32 or fp16")

    @functools.cached_property
    def identity(self) -> str:
        """A digest of the model file (and its upper-band head's weights): a stream's state is
        only continued by an engine of the same identity (`enhancer.handoff`)."""
        import hashlib

        h = hashlib.sha256(self.path.read_bytes())
        head = self.path.with_name(HEAD_WEIGHTS)
        if self.upper_head is not None and head.is_file():
            h.update(head.read_bytes())
        return h.hexdigest()[:32]

    @property
    def int8_rings(self) -> bool:
        """The key/value rings are int8, key rings transposed (`enhancer.build.ringquant`)."""
        return self.ring_format == "int8"

    def run(self, hops: np.ndarray, min_gain: np.ndarray, pos: np.ndarray, caches: list[np.ndarray]) -> StepOutputs:
        """One graph call: hops (B, T, hop) for B streams whose first frame is at `pos` (B,); its
        outputs decoded by the graph's output names."""
        values = self.session.run(None, dict(zip(self.input_names, [hops, min_gain, pos, *caches])))
        return StepOutputs.decode(self.config, values, self.output_names)


class Stepping:
    """`step`, the live step, as a one-frame `run` (every pool's `run` takes (k, T, hop)), and the
    defaults of `enhancer.pools.LanePoolProtocol`'s optional members: no full-pool live step, and
    always connected (a local pool)."""

    full_step = None  # DeviceLanePool's full-pool live step, when it has one
    connected = True  # RemoteLanePool: whether its step server answers

    def run(self, lanes: np.ndarray, hops: np.ndarray, min_gain: np.ndarray) -> StepResult:
        raise NotImplementedError

    def step(self, lanes: np.ndarray, hops: np.ndarray, min_gain: np.ndarray) -> StepResult:
        """Advance `lanes` (distinct) by one hop each: hops (k, hop) -> out (k, hop) (the live step)."""
        r = self.run(lanes, hops[:, None], min_gain)
        comp = None if r.competition is None else r.competition[:, 0]
        return StepResult(out=r.out[:, 0], competition=comp, activity=r.activity[:, 0])


def lane_range(lanes: np.ndarray, hops: np.ndarray, min_gain: np.ndarray):
    """A call over `lanes` (distinct) covers the range [lo, hi) of them: (lo, hi, idx, whole, h, g)
    with idx the lanes' rows in that range, whole whether they are the range itself in order, and
    h, g the call's hops and gain floors over the range (zeros on the rows not stepping)."""
    lo, hi = int(lanes.min()), int(lanes.max()) + 1
    idx = lanes - lo
    if hi - lo == len(lanes) and np.array_equal(idx, np.arange(len(lanes))):
        return lo, hi, idx, True, np.ascontiguousarray(hops, dtype=np.float32), \
            np.ascontiguousarray(min_gain, dtype=np.float32)
    h = np.zeros((hi - lo,) + hops.shape[1:], dtype=np.float32)
    g = np.zeros(hi - lo, dtype=np.float32)
    h[idx], g[idx] = hops, min_gain
    return lo, hi, idx, False, h, g


class Lanes(Stepping):
    """Which of a pool's `capacity` lanes are free (the lowest first); `alloc` resets the lanes it
    hands out (`reset`, the pool's). A subclass sets `capacity` and calls `_init_lanes`."""

    capacity: int

    def _init_lanes(self) -> None:
        self.free_lanes = list(range(self.capacity))
        self.lock = threading.Lock()

    def alloc(self, n: int) -> np.ndarray:
        with self.lock:
            if n > len(self.free_lanes):
                raise RuntimeError(f"no free lanes: {n} requested, {len(self.free_lanes)} free of {self.capacity}")
            self.free_lanes.sort()
            lanes, self.free_lanes = self.free_lanes[:n], self.free_lanes[n:]
        lanes = np.array(lanes, dtype=np.int64)
        self.reset(lanes)
        return lanes

    def free(self, lanes) -> None:
        with self.lock:
            self.free_lanes.extend(int(x) for x in lanes)

    @property
    def n_free(self) -> int:
        return len(self.free_lanes)

    def reset(self, lanes: np.ndarray) -> None:
        raise NotImplementedError


class LanePool(Lanes):
    """Batched per-stream state: `capacity` lanes, each one channel of one stream."""

    def __init__(self, engine: Engine, capacity: int):
        self.engine, self.capacity = engine, capacity
        cfg = engine.config
        states = init_states(cfg, capacity)
        # the key/value rings live in one array (2N, capacity, H, W, dh), so that one step's new rows
        # are written with one assignment; each ring, and each lane range of it, is a contiguous view
        # (np.zeros: pages of lanes never used are never touched, so they cost no memory)
        self.rings = init_rings(cfg, capacity, np.int8 if engine.int8_rings else np.float32)
        self.n_state = len(states)
        self.caches = states + ring_views(self.rings, engine.int8_rings)
        self.pos = np.zeros(capacity, dtype=np.int64)
        self._init_lanes()

    def reset(self, lanes: np.ndarray) -> None:
        for c in self.caches:
            c[lanes] = 0
        self.pos[lanes] = 0

    def export_lanes(self, lanes: np.ndarray) -> dict[str, np.ndarray]:
        names = [name for name, _ in cache_specs(self.engine.config)]
        out = {name: c[lanes] for name, c in zip(names, self.caches)}  # fancy indexing: copies
        out["pos"] = self.pos[lanes]
        return out

    def import_lanes(self, lanes: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        arrays = check_lane_arrays(self.engine, len(lanes), arrays)
        names = [name for name, _ in cache_specs(self.engine.config)]
        for name, c in zip(names, self.caches):
            c[lanes] = arrays[name]
        self.pos[lanes] = arrays["pos"]

    def run(self, lanes: np.ndarray, hops: np.ndarray, min_gain: np.ndarray) -> StepResult:
        """Advance `lanes` (distinct) by T hops each in one call: hops (k, T, hop) -> out (k, T, hop),
        the same as T calls of `step`. The call covers the lane range [min, max]; lanes in it that
        are not stepping are computed but left untouched."""
        eng = self.engine
        lo, hi, idx, whole, h, g = lane_range(lanes, hops, min_gain)
        sel = slice(None) if whole else idx  # the whole range, in order: plain views, no gathers
        views = [c[lo:hi] for c in self.caches]  # contiguous views, no copies
        pos = self.pos[lo:hi]
        o = eng.run(h, g, pos.copy(), views)
        write_rings(self.rings, o.kv_rows[sel], pos[sel], eng.config.attention_window, lanes, eng.int8_rings)
        for view, new in zip(views[:self.n_state], o.states):
            view[sel] = new[sel]
        pos[sel] += hops.shape[1]
        comp = None if o.competition is None else o.competition[sel]
        return StepResult(out=o.out[sel], competition=comp, activity=o.activity[sel])
