"""Inference runtime: numpy + onnxruntime. Never imports torch.

    enh = Enhancer.from_pretrained()                 # the shipped model in models/
    clean = enh.enhance(noisy, 48000)                # (n,) or (n, channels), same shape out
    speech = enh.enhance(noisy, 48000, band="speech")  # only the model's band (up to 8 kHz)
    louder = enh.enhance(noisy, 48000, level="input")  # the voice at the input's speech level
    s = enh.stream(sample_rate=48000, channels=2)
    out = s.feed(chunk); ...; out_tail = s.flush()   # any chunk size; total out == total in

Every path runs the exported step graph, whose time axis is dynamic: a live stream steps one
16 ms hop per call (many streams batched in one call by the server's scheduler), while audio that is
already there -- a file, a block fed at once, a stream's backlog -- goes through in calls of up to
`OFFLINE_FRAMES` hops, so every weight is read once per chunk instead of once per hop. Both give
the same output (a graph with 8-bit key/value rings, as shipped: within their quantization,
`enhancer.build.ringquant`). Above 16 kHz the band above 8 kHz is added back (`band="full"`, the default): delay-
aligned with the enhanced low band and cleaned by per-band gains that follow its noise and the
model's speech activity (`enhancer.fullband`); `band="speech"` returns the model's band only.
`level="input"` multiplies the output by a running gain that gives the voice back at the input's
speech level (`enhancer.level`); the default, `level="model"`, is the model's output as it is.
Per-stream state lives in a `LanePool`: batched cache arrays in which each stream (channel) owns a
lane, and a stream's key/value rings are written in place.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .config import SAMPLE_RATE
from .cursor import StepLog, StreamCursor
from .engine import Engine, LanePool, StepResult, min_gain_for
from .errors import CheckpointError
from .fullband import BANDS, DEFAULT_BAND
from .level import DEFAULT_LEVEL, LEVELS
from .pools import LanePoolProtocol
from .signal import check_audio, check_rate

__all__ = [
    "BANDS",
    "DEFAULT_BAND",
    "DEFAULT_LEVEL",
    "DEFAULT_MODEL",
    "LEVELS",
    "MODELS_DIR",
    "OFFLINE_FRAMES",
    "PACKAGE_MODELS_DIR",
    "Engine",
    "Enhancer",
    "LanePool",
    "LanePoolProtocol",
    "StepResult",
    "StreamCursor",
    "StreamingEnhancer",
    "default_model_path",
    "min_gain_for",
]

PACKAGE_MODELS_DIR = Path(__file__).resolve().parent / "models"  # an installed wheel: enhancer/models/
MODELS_DIR = Path(__file__).resolve().parent.parent / "models"  # a source checkout: models/ beside enhancer/
DEFAULT_MODEL = "tim.onnx"
# Frames (16 ms hops) per call when audio is already there: `enhancer bench` measures the offline
# real-time factor at several sizes (`offline_frames`); from about 32 on the weights are read
# rarely enough that the call is bound by arithmetic, and the in-call attention grows with T (each
# frame attends the window's W ring slots and the call's T frames: W + T scores, W = 256).
OFFLINE_FRAMES = 64


def default_model_path() -> Path:
    """The shipped model: enhancer/models/tim.onnx in an installed package (the wheel carries it
    there), else models/tim.onnx of the source checkout the package runs from (editable install, or
    the repository on the path). When none exists, the last candidate looked at (for the error
    message). The environment plays no part: a command line that honours $TIM_ENHANCER_MODEL
    passes its path instead."""
    candidates = [PACKAGE_MODELS_DIR / DEFAULT_MODEL, MODELS_DIR / DEFAULT_MODEL]
    return next((p for p in candidates if p.is_file()), candidates[-1])


class StreamingEnhancer:
    """One audio stream (any rate, any channel count) through the step graph.

    `feed(pcm)` takes any number of samples, shape (n,) for mono or (n, channels), and returns the
    enhanced samples that are ready; `flush()` returns the rest, so that the total output has
    exactly as many samples as the total input, aligned sample for sample (the model's fixed delay
    is removed). After `flush()` the stream is fresh again. `reset()` drops everything; `close()`
    gives its lanes back to a shared pool.

    `feed` runs whatever input is ready in calls of up to `frames_per_call` hops (`OFFLINE_FRAMES`):
    a long block goes through at file speed, a 16 ms chunk as one live step; the output does not
    depend on the chunking (with 8-bit rings, beyond their quantization). With `metadata=True`, `metadata.pop()` returns each step's
    `StepFrame` (competition and activity) since the last pop.

    Above 16 kHz, `band="full"` (the default) adds the band above 8 kHz back, cleaned by per-band
    gains that follow its noise and the model's speech activity; `band="speech"` gives the model's
    band only. `level="input"`
    gives the voice back at the input's speech level (`enhancer.level`); `level="model"` (the
    default) leaves the model's output as it is.

    A scheduler that steps many streams in one call drives a `StreamCursor` instead (`cursor`).
    """

    def __init__(self, engine: Engine, sample_rate: int = SAMPLE_RATE, channels: int = 1, atten_lim_db: float | None = None,
                 metadata: bool = False, pool: LanePoolProtocol | None = None, band: str = DEFAULT_BAND,
                 level: str = DEFAULT_LEVEL):
        self._cursor = StreamCursor(engine, sample_rate, channels, atten_lim_db, metadata, pool, band, level)
        self.frames_per_call = OFFLINE_FRAMES

    @property
    def cursor(self) -> StreamCursor:
        """This stream's cursor, for callers that step it in a batch with other streams."""
        return self._cursor

    @property
    def config(self):
        return self._cursor.config

    @property
    def sample_rate(self) -> int:
        return self._cursor.sample_rate

    @property
    def channels(self) -> int:
        return self._cursor.channels

    @property
    def band(self) -> str:
        return self._cursor.band

    @property
    def level(self) -> str:
        return self._cursor.level

    @property
    def pool(self) -> LanePoolProtocol:
        return self._cursor.pool

    @property
    def lanes(self) -> np.ndarray:
        """The pool lanes of this stream, one per channel."""
        return self._cursor.lanes

    @property
    def closed(self) -> bool:
        return self._cursor.closed

    @property
    def metadata(self) -> StepLog:
        """Per-step metadata (with `metadata=True`): `metadata.pop()` returns the steps since the
        last pop."""
        return self._cursor.log

    def feed(self, pcm) -> np.ndarray:
        """Enhance `pcm`; returns the enhanced samples that are ready (same shape convention)."""
        c = self._cursor
        c.push(pcm)
        self._run_ready()
        return self._shape(c.pull())

    def flush(self) -> np.ndarray:
        """Process the tail and return it; the stream then starts afresh."""
        c = self._cursor
        c.begin_flush()
        self._run_ready()
        result = self._shape(c.end_flush())
        c.reset()
        return result

    def reset(self) -> None:
        """Drop all state and buffered audio; the next `feed` starts a new stream."""
        self._cursor.reset()

    def close(self) -> None:
        """Give the lanes back to the pool (for pools shared by many streams)."""
        self._cursor.close()

    def _run_ready(self) -> None:
        c = self._cursor
        while n := min(c.ready_hops(), self.frames_per_call):
            r = c.pool.run(c.lanes, c.take_hops(n), c.gains)
            c.put_outputs(r.out, r.competition, r.activity)

    def _shape(self, y: np.ndarray) -> np.ndarray:
        """(n, 1) -> (n,) for mono streams."""
        return y[:, 0].copy() if self._cursor.channels == 1 else y


class Enhancer:
    """The model, loaded once; `enhance` for whole signals, `stream` for live audio."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.config = engine.config

    @classmethod
    def from_pretrained(cls, path=None, providers=None, threads: int = 1) -> Enhancer:
        """Load the exported model at `path` (None: the shipped one, `default_model_path`).
        `providers`: onnxruntime providers in order of preference (default: CUDA when available,
        then CPU); `.provider` tells which one is really used."""
        p = Path(path) if path is not None else default_model_path()
        if path is None and not p.is_file():
            raise CheckpointError(f"no shipped model at {PACKAGE_MODELS_DIR / DEFAULT_MODEL} or {p}; pass a path "
                                  "(the command line: --model, or $TIM_ENHANCER_MODEL)")
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
               metadata: bool = False, pool: LanePoolProtocol | None = None, band: str = DEFAULT_BAND,
               level: str = DEFAULT_LEVEL) -> StreamingEnhancer:
        """A stream (see `StreamingEnhancer`); `band`: "full" (default) or "speech"; `level`:
        "model" (default) or "input"."""
        return StreamingEnhancer(self.engine, sample_rate, channels, atten_lim_db, metadata, pool, band, level)

    def enhance(self, audio, sample_rate: int, atten_lim_db: float | None = None, chunk_seconds: float = 10.0,
                band: str = DEFAULT_BAND, level: str = DEFAULT_LEVEL) -> np.ndarray:
        """Enhance a whole signal: (n,) or (n, channels) at any rate -> the same shape and rate.
        Above 16 kHz `band="full"` (default) keeps the band above 8 kHz, `band="speech"` does not.
        `level="input"` gives the voice back at the input's speech level; `level="model"` (default)
        is the model's output as it is."""
        a = check_audio(audio)
        sr = check_rate(sample_rate)
        channels = 1 if a.ndim == 1 else a.shape[1]
        s = self.stream(sr, channels, atten_lim_db, band=band, level=level)
        step = max(1, int(chunk_seconds * sr))
        parts = [s.feed(a[i:i + step]) for i in range(0, a.shape[0], step)]
        parts.append(s.flush())
        return np.concatenate(parts, axis=0).reshape(a.shape)
