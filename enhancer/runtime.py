"""Inference runtime: numpy + onnxruntime (+ soxr for resampling). Never imports torch.

    enh = Enhancer.from_pretrained()                 # the shipped model in models/
    clean = enh.enhance(noisy, 48000)                # (n,) or (n, channels), same shape out
    s = enh.stream(sample_rate=48000, channels=2)
    out = s.feed(chunk); ...; out_tail = s.flush()   # any chunk size; total out == total in

Every path runs the exported step graph, whose time axis is dynamic: a live stream steps one
16 ms hop per call (many streams batched in one call by the server's scheduler), while audio that is
already there -- a file, a block fed at once, a stream's backlog -- goes through in calls of up to
`OFFLINE_FRAMES` hops, so every weight is read once per chunk instead of once per hop. Both give
the same output. Per-stream state lives in a `LanePool`: batched cache arrays in which each stream
(channel) owns a lane, and a stream's key/value rings are written in place.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import SAMPLE_RATE, ModelConfig
from .devices import PROVIDERS
from .errors import AudioError, CheckpointError
from .step_io import STEP_FORMAT, StepOutputs, init_rings, init_states, input_names, output_names, write_rings
from .signal import StreamResampler, check_audio, check_rate

PACKAGE_MODELS_DIR = Path(__file__).resolve().parent / "models"  # an installed wheel: enhancer/models/
MODELS_DIR = Path(__file__).resolve().parent.parent / "models"  # a source checkout: models/ beside enhancer/
DEFAULT_MODEL = "tim.onnx"
MODEL_ENV = "TIM_ENHANCER_MODEL"
# Frames (16 ms hops) per call when audio is already there: `enhancer bench` measures the offline
# real-time factor at several sizes (`offline_frames`); from about 32 on the weights are read
# rarely enough that the call is bound by arithmetic, and the in-call attention grows with T.
OFFLINE_FRAMES = 128


def default_model_path() -> Path:
    """$TIM_ENHANCER_MODEL, else the shipped model: enhancer/models/tim.onnx in an installed
    package (the wheel carries it there), else models/tim.onnx of the source checkout the package
    runs from (editable install, or the repository on the path). When none exists, the last
    candidate looked at (for the error message)."""
    env = os.environ.get(MODEL_ENV)
    if env:
        return Path(env)
    candidates = [PACKAGE_MODELS_DIR / DEFAULT_MODEL, MODELS_DIR / DEFAULT_MODEL]
    return next((p for p in candidates if p.is_file()), candidates[-1])


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


class Engine:
    """One onnxruntime session of a step graph, with the config read from the model's metadata."""

    def __init__(self, path, providers=None, threads: int = 1):
        import onnxruntime as ort

        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"model file not found: {path}")
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        if providers is None:  # "auto"
            avail = ort.get_available_providers()
            providers = [p for p in PROVIDERS["cuda"] if p in avail]
        try:
            self.session = ort.InferenceSession(str(path), so, providers=list(providers))
        except Exception as e:  # noqa: BLE001 - onnxruntime raises several unrelated types
            raise CheckpointError(f"{path}: cannot load model ({type(e).__name__}: {e})") from None
        meta = self.session.get_modelmeta().custom_metadata_map
        if "tim_enhancer.config" not in meta:
            raise CheckpointError(f"{path}: not a tim-enhancer step graph (no tim_enhancer.config metadata)")
        if meta.get("tim_enhancer.step_format") != STEP_FORMAT:
            raise CheckpointError(f"{path}: step graph format {meta.get('tim_enhancer.step_format', '1')!r}, this runtime "
                                  f"needs {STEP_FORMAT!r}; re-export it from its checkpoint with `enhancer export CKPT -o MODEL`")
        self.path = path
        self.config = ModelConfig.from_dict(json.loads(meta["tim_enhancer.config"]))
        self.metadata = {k.split(".", 1)[1]: v for k, v in meta.items() if k.startswith("tim_enhancer.")}
        got_in = [i.name for i in self.session.get_inputs()]
        got_out = [o.name for o in self.session.get_outputs()]
        if got_in != input_names(self.config) or sorted(got_out) != sorted(output_names(self.config)):
            raise CheckpointError(f"{path}: graph inputs/outputs do not match its config {self.config.name!r}")
        self.input_names, self.output_names = got_in, got_out

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

    def run(self, hops: np.ndarray, min_gain: np.ndarray, pos: np.ndarray, caches: list[np.ndarray]) -> StepOutputs:
        """One graph call: hops (B, T, hop) for B streams whose first frame is at `pos` (B,); its
        outputs decoded by the graph's output names."""
        values = self.session.run(None, dict(zip(self.input_names, [hops, min_gain, pos, *caches])))
        return StepOutputs.decode(self.config, values, self.output_names)


class LanePool:
    """Batched per-stream state: `capacity` lanes, each one channel of one stream."""

    def __init__(self, engine: Engine, capacity: int):
        self.engine, self.capacity = engine, capacity
        cfg = engine.config
        states = init_states(cfg, capacity)
        # the key/value rings live in one array (2N, capacity, H, W, dh), so that one step's new rows
        # are written with one assignment; each ring, and each lane range of it, is a contiguous view
        # (np.zeros: pages of lanes never used are never touched, so they cost no memory)
        self.rings = init_rings(cfg, capacity)
        self.n_state = len(states)
        self.caches = states + list(self.rings)
        self.pos = np.zeros(capacity, dtype=np.int64)
        self.free_lanes = list(range(capacity))
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
        for c in self.caches:
            c[lanes] = 0.0
        self.pos[lanes] = 0

    def step(self, lanes: np.ndarray, hops: np.ndarray, min_gain: np.ndarray) -> StepResult:
        """Advance `lanes` (distinct) by one hop each: hops (k, hop) -> out (k, hop) (the live step)."""
        r = self.run(lanes, hops[:, None], min_gain)
        comp = None if r.competition is None else r.competition[:, 0]
        return StepResult(out=r.out[:, 0], competition=comp, activity=r.activity[:, 0])

    def run(self, lanes: np.ndarray, hops: np.ndarray, min_gain: np.ndarray) -> StepResult:
        """Advance `lanes` (distinct) by T hops each in one call: hops (k, T, hop) -> out (k, T, hop),
        the same as T calls of `step`. The call covers the lane range [min, max]; lanes in it that
        are not stepping are computed but left untouched."""
        eng = self.engine
        lo, hi = int(lanes.min()), int(lanes.max()) + 1
        idx = lanes - lo
        if hi - lo == len(lanes) and np.array_equal(idx, np.arange(len(lanes))):
            sel = slice(None)  # the lanes are the whole range, in order: plain views, no gathers
            h, g = np.ascontiguousarray(hops, dtype=np.float32), np.ascontiguousarray(min_gain, dtype=np.float32)
        else:
            sel = idx
            h = np.zeros((hi - lo,) + hops.shape[1:], dtype=np.float32)
            g = np.zeros(hi - lo, dtype=np.float32)
            h[idx], g[idx] = hops, min_gain
        views = [c[lo:hi] for c in self.caches]  # contiguous views, no copies
        pos = self.pos[lo:hi]
        o = eng.run(h, g, pos.copy(), views)
        write_rings(self.rings, o.kv_rows[sel], pos[sel], eng.config.attention_window, lanes)
        for view, new in zip(views[:self.n_state], o.states):
            view[sel] = new[sel]
        pos[sel] += hops.shape[1]
        comp = None if o.competition is None else o.competition[sel]
        return StepResult(out=o.out[sel], competition=comp, activity=o.activity[sel])


class StreamingEnhancer:
    """One audio stream (any rate, any channel count) through the step graph.

    `feed(pcm)` takes any number of samples, shape (n,) for mono or (n, channels), and returns the
    enhanced samples that are ready; `flush()` returns the rest, so that the total output has
    exactly as many samples as the total input, aligned sample for sample (the model's fixed delay
    is removed). After `flush()` the stream is fresh again. `reset()` drops everything.

    `feed` runs whatever input is ready in calls of up to `frames_per_call` hops (`OFFLINE_FRAMES`):
    a long block goes through at file speed, a 16 ms chunk as one live step; the output does not
    depend on the chunking.

    For batched serving, `push()` / `ready_hops()` / `take_hop()` / `put_output()` / `pull()` split
    `feed` so that a scheduler can step many streams in one call (`LanePool.step`); `take_hops(n)` /
    `put_outputs()` do the same for a backlog of n hops of one stream in one call (`LanePool.run`).
    """

    def __init__(self, engine: Engine, sample_rate: int = SAMPLE_RATE, channels: int = 1, atten_lim_db: float | None = None,
                 metadata: bool = False, pool: LanePool | None = None):
        self.engine, self.config = engine, engine.config
        self.sample_rate = check_rate(sample_rate)
        if not isinstance(channels, (int, np.integer)) or not 1 <= channels <= 64:
            raise AudioError(f"channels must be an integer in 1..64, got {channels!r}")
        self.channels = int(channels)
        self.min_gain = min_gain_for(atten_lim_db)
        self.metadata = metadata
        self.pool = pool or LanePool(engine, self.channels)
        self.lanes = self.pool.alloc(self.channels)
        self.closed = False
        self.frames_per_call = OFFLINE_FRAMES
        self._init_buffers()

    def _init_buffers(self) -> None:
        sr, c, model_sr = self.sample_rate, self.channels, self.config.stft.sample_rate
        self._rs_in = StreamResampler(sr, model_sr, c)
        self._rs_out = StreamResampler(model_sr, sr, c)
        self._pending = np.zeros((0, c), dtype=np.float32)  # 16 kHz input not yet stepped
        self._to_drop = self.config.delay_samples  # leading output samples that are pure delay
        self._ready = []  # 16 kHz output hops, (hop, c) each
        self.n_in = 0  # samples fed, at the stream's rate
        self.n_in_model = 0  # the same after resampling to 16 kHz
        self.n_out = 0  # samples returned, at the stream's rate
        self.frames = []  # metadata per step: (competition (c, n_tim, n_s) | None, activity (c,))

    # ------------------------------------------------------------------ simple interface
    def feed(self, pcm) -> np.ndarray:
        self.push(pcm)
        self._run_pending()
        return self.pull()

    def flush(self) -> np.ndarray:
        """Process the tail and return it; the stream then starts afresh."""
        self.begin_flush()
        self._run_pending()
        result = self._shape(self.end_flush())
        self.reset()
        return result

    def begin_flush(self) -> None:
        """First half of `flush` for a scheduler that runs the steps itself: drain the input
        resampler and pad zeros so that the hops still to run cover every input sample plus the
        model's delay (`ready_hops()` tells how many)."""
        self._check_open()
        self._append(self._rs_in.process(np.zeros((0, self.channels), np.float32), last=True))
        hop = self.config.stft.hop
        need = self.config.delay_samples + self.n_in_model  # stream samples covering every input sample
        steps = -(-max(need - self._produced_model_samples(), 0) // hop)
        missing = steps * hop - len(self._pending)
        if missing > 0:
            self._pending = np.concatenate([self._pending, np.zeros((missing, self.channels), np.float32)])

    def end_flush(self) -> np.ndarray:
        """Second half, once those hops have run: the tail as (n, channels), so that the total
        output length equals the total input length. Does not reset the stream."""
        out = self.pull(last=True)
        remaining = self.n_in - self.n_out
        if out.shape[0] < remaining:  # resampler rounding: pad the last sample(s) with zeros
            out = np.concatenate([out, np.zeros((remaining - out.shape[0], self.channels), np.float32)])
        out = out[:max(remaining, 0)]
        self.n_out += out.shape[0]
        return out

    def reset(self) -> None:
        """Drop all state and buffered audio; the next `feed` starts a new stream."""
        self._check_open()
        self.pool.reset(self.lanes)
        self._init_buffers()

    def close(self) -> None:
        """Give the lanes back to the pool (for pools shared by many streams)."""
        if not self.closed:
            self.pool.free(self.lanes)
            self.closed = True

    def pop_metadata(self) -> list[dict]:
        """Per-step metadata since the last call: competition (channels, n_tim, n_s) and activity."""
        frames, self.frames = self.frames, []
        return [{"competition": c, "activity": a} for c, a in frames]

    # ------------------------------------------------------------------ split interface
    def push(self, pcm, name: str = "pcm") -> None:
        """Queue input audio; `name` is how errors refer to it."""
        self._check_open()
        a = np.asarray(pcm)
        if a.size == 0 and a.ndim in (1, 2):
            return
        a = check_audio(a, name)
        if a.ndim == 1:
            a = a[:, None]
        if a.shape[1] != self.channels:
            raise AudioError(f"{name} has {a.shape[1]} channel(s), the stream was opened with {self.channels}")
        self.n_in += a.shape[0]
        self._append(self._rs_in.process(a))

    def ready_hops(self) -> int:
        return len(self._pending) // self.config.stft.hop

    def take_hop(self) -> np.ndarray:
        """The next input hop as (channels, hop)."""
        hop = self.config.stft.hop
        x, self._pending = self._pending[:hop], self._pending[hop:]
        return np.ascontiguousarray(x.T)

    def take_hops(self, n: int) -> np.ndarray:
        """The next n input hops (n <= `ready_hops()`) as (channels, n, hop), for `LanePool.run`."""
        hop = self.config.stft.hop
        if not 0 < n <= self.ready_hops():
            raise ValueError(f"take_hops({n}): {self.ready_hops()} hop(s) ready")
        x, self._pending = self._pending[:n * hop], self._pending[n * hop:]
        return np.ascontiguousarray(x.reshape(n, hop, self.channels).transpose(2, 0, 1))

    def put_output(self, out: np.ndarray, competition, activity) -> None:
        """One step's result for this stream's lanes: out (channels, hop)."""
        self._ready.append(out.T)
        if self.metadata:
            self.frames.append((competition, activity))

    def put_outputs(self, out: np.ndarray, competition, activity) -> None:
        """The result of `take_hops(n)` run in one call: out (channels, n, hop), competition
        (channels, n, n_tim, n_s) or None, activity (channels, n) or None."""
        self._ready.append(out.transpose(1, 2, 0).reshape(-1, self.channels))
        if self.metadata:
            for t in range(out.shape[1]):
                self.frames.append((None if competition is None else competition[:, t],
                                    None if activity is None else activity[:, t]))

    def pull(self, last: bool = False) -> np.ndarray:
        """Enhanced audio at the stream's rate that is ready, delay removed."""
        if self._ready:
            y = np.concatenate(self._ready)
            self._ready = []
        else:
            y = np.zeros((0, self.channels), np.float32)
        if self._to_drop:
            d = min(self._to_drop, len(y))
            y, self._to_drop = y[d:], self._to_drop - d
        y = self._rs_out.process(y, last=last)
        if last:
            return y
        y = y[: max(self.n_in - self.n_out, 0)]
        self.n_out += y.shape[0]
        return self._shape(y)

    # ------------------------------------------------------------------ internals
    def _append(self, x: np.ndarray) -> None:
        if len(x):
            self.n_in_model += len(x)
            self._pending = np.concatenate([self._pending, x.astype(np.float32, copy=False)])

    def _produced_model_samples(self) -> int:
        return int(self.pool.pos[self.lanes[0]]) * self.config.stft.hop

    def _run_pending(self) -> None:
        g = np.full(self.channels, self.min_gain, np.float32)
        while n := min(self.ready_hops(), self.frames_per_call):
            r = self.pool.run(self.lanes, self.take_hops(n), g)
            self.put_outputs(r.out, r.competition, r.activity)

    def _shape(self, y: np.ndarray) -> np.ndarray:
        """(n, 1) -> (n,) for mono streams."""
        return y[:, 0].copy() if self.channels == 1 else y

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("stream is closed")


class Enhancer:
    """The model, loaded once; `enhance` for whole signals, `stream` for live audio."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.config = engine.config

    @classmethod
    def from_pretrained(cls, path=None, providers=None, threads: int = 1) -> "Enhancer":
        """Load an exported model (default: the shipped one). `providers`: onnxruntime providers
        in order of preference (default: CUDA when available, then CPU); `.provider` tells which
        one is really used."""
        p = Path(path) if path is not None else default_model_path()
        if path is None and not p.is_file():
            where = p if os.environ.get(MODEL_ENV) else f"{PACKAGE_MODELS_DIR / DEFAULT_MODEL} or {p}"
            raise CheckpointError(f"no shipped model at {where}; pass a path or set ${MODEL_ENV}")
        return cls(Engine(p, providers, threads))

    @property
    def provider(self) -> str:
        return self.engine.provider

    @property
    def sample_rate(self) -> int:
        return self.config.stft.sample_rate

    @property
    def delay_samples(self) -> int:
        return self.config.delay_samples

    @property
    def latency_ms(self) -> float:
        return self.config.algorithmic_latency_ms

    def stream(self, sample_rate: int = SAMPLE_RATE, channels: int = 1, atten_lim_db: float | None = None,
               metadata: bool = False, pool: LanePool | None = None) -> StreamingEnhancer:
        return StreamingEnhancer(self.engine, sample_rate, channels, atten_lim_db, metadata, pool)

    def enhance(self, audio, sample_rate: int, atten_lim_db: float | None = None, chunk_seconds: float = 10.0) -> np.ndarray:
        """Enhance a whole signal: (n,) or (n, channels) at any rate -> the same shape and rate."""
        a = check_audio(audio)
        sr = check_rate(sample_rate)
        channels = 1 if a.ndim == 1 else a.shape[1]
        s = self.stream(sr, channels, atten_lim_db)
        step = max(1, int(chunk_seconds * sr))
        parts = [s.feed(a[i:i + step]) for i in range(0, a.shape[0], step)]
        parts.append(s.flush())
        return np.concatenate(parts, axis=0).reshape(a.shape)
