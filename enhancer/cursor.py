"""A scheduler's handle on one stream: `StreamCursor`.

`StreamingEnhancer.feed` runs a stream's ready hops itself. A scheduler that steps many streams in
one call (the service's batcher) drives each stream through its cursor instead: audio in (`push`),
input hops out (`take_hop`, or `take_hops(n)` for a multi-frame call), each call's result back in
(`put_output`, `put_outputs`), or hops skipped to catch up (`skip`), and enhanced audio out
(`pull`). `begin_flush` / `end_flush` frame the hops that finish the stream. Every piece of the
stream's sample arithmetic lives here: resampling, the model's delay, the padding of the tail,
where a hop or a skipped run of hops lands in the output, and, for a stream above 16 kHz, the upper
band kept beside the model's (`band="full"`, `enhancer.fullband.HighBand`), and with `level="input"`
the running gain that gives the voice back at the input's level (`enhancer.level.LevelGain`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import handoff
from .config import SAMPLE_RATE, ModelConfig
from .device_pool import make_pool
from .engine import Engine, min_gain_for
from .errors import AudioError
from .fullband import DEFAULT_BAND, HighBand, check_band, uses_high_band
from .level import DEFAULT_LEVEL, LevelGain, check_level
from .pools import LanePoolProtocol
from .resample import StreamResampler, round_trip_ms
from .signal import MAX_CHANNELS, check_audio, check_rate


def check_channels(channels, limit: int = MAX_CHANNELS) -> int:
    """`channels` as an int, or AudioError unless it is an integer in 1..limit."""
    if not isinstance(channels, (int, np.integer)) or isinstance(channels, bool) or not 1 <= channels <= limit:
        raise AudioError(f"channels must be an integer in 1..{limit}, got {channels!r}")
    return int(channels)


def latency_at(config: ModelConfig, sample_rate: int) -> float:
    """A stream's algorithmic latency in ms at `sample_rate`: the model's (window and lookahead)
    and, at another rate than the model's, the resamplers' in and out (`enhancer.resample`)."""
    return config.algorithmic_latency_ms + round_trip_ms(sample_rate, config.stft.sample_rate)


def delay_at(config: ModelConfig, sample_rate: int) -> int:
    """Input samples at `sample_rate` a stream takes beyond an output sample before it can give it:
    the model's delay and the resamplers' (the output is aligned: `StreamCursor.pull` removes it)."""
    model = config.stft.sample_rate
    ms = 1000.0 * config.delay_samples / model + round_trip_ms(sample_rate, model)
    return round(ms * sample_rate / 1000.0)


@dataclass(frozen=True)
class StepFrame:
    """Metadata of one step of a stream's lanes."""

    index: int  # the hop's index in the stream
    time_s: float | None  # where the hop's output starts (s); None: the hop only fills the model's delay
    competition: np.ndarray | None  # (channels, n_tim, n_s); None for models without mechanisms
    activity: np.ndarray | None  # (channels,)


class StepLog:
    """Per-step metadata of a stream, kept until popped (nothing is kept when disabled)."""

    def __init__(self, config: ModelConfig, enabled: bool):
        self.enabled = bool(enabled)
        self._hop, self._delay, self._rate = config.stft.hop, config.delay_samples, config.stft.sample_rate
        self._frames: list[StepFrame] = []

    def record(self, index: int, competition, activity) -> None:
        if self.enabled:
            start = index * self._hop - self._delay  # first output sample (model rate) of the hop
            self._frames.append(StepFrame(index, start / self._rate if start >= 0 else None, competition, activity))

    def pop(self) -> list[StepFrame]:
        """The frames recorded since the last call."""
        frames, self._frames = self._frames, []
        return frames

    def __len__(self) -> int:
        return len(self._frames)


class StreamCursor(handoff.StreamState):
    """One stream's buffers and lanes, stepped by its owner (see the module docstring)."""

    def __init__(self, engine: Engine, sample_rate: int = SAMPLE_RATE, channels: int = 1,
                 atten_lim_db: float | None = None, metadata: bool = False, pool: LanePoolProtocol | None = None,
                 band: str = DEFAULT_BAND, level: str = DEFAULT_LEVEL):
        self.engine, self.config = engine, engine.config
        self.upper_head = engine.upper_head  # the upper band's learned gains (None: the Wiener gains alone)
        self.sample_rate = check_rate(sample_rate)
        self.channels = check_channels(channels)
        self.min_gain = min_gain_for(atten_lim_db)
        self.band = check_band(band)  # "full": keep the band above 8 kHz (above 16 kHz); "speech": up to 8 kHz
        self.full_band = uses_high_band(self.band, self.sample_rate, self.config.stft.sample_rate)
        self.level = check_level(level)  # "model": the model's output as it is; "input": the input's speech level
        self.gains = np.full(self.channels, self.min_gain, np.float32)  # per lane, for `LanePool.step` / `run`
        self.pool = pool or make_pool(engine, self.channels)
        self.lanes = self.pool.alloc(self.channels)
        self.log = StepLog(self.config, metadata)
        self.closed = False
        self._clear()

    def _clear(self) -> None:
        sr, c, model_sr = self.sample_rate, self.channels, self.config.stft.sample_rate
        self._rs_in = StreamResampler(sr, model_sr, c)
        self._rs_out = StreamResampler(model_sr, sr, c)
        self._high = (HighBand(self.config, sr, c, self.min_gain, self.upper_head)
                      if self.full_band else None)
        self._level = LevelGain(self.config, sr) if self.level == "input" else None
        self._pending = np.zeros((0, c), dtype=np.float32)  # model-rate input not yet stepped
        self._to_drop = self.config.delay_samples  # leading output samples that are pure delay
        self._ready: list[np.ndarray] = []  # model-rate output, (n, c) each
        self.n_in = 0  # samples pushed, at the stream's rate
        self.n_in_model = 0  # the same after resampling to the model's rate
        self.n_out = 0  # samples pulled, at the stream's rate
        self.hops_out = 0  # hops stepped or skipped so far: the index of the next hop
        self.skipped = 0  # hops skipped (their output is zeros)
        self.log.pop()

    # ------------------------------------------------------------------ input
    def push(self, pcm, name: str = "pcm") -> None:
        """Queue input audio (n,) or (n, channels); `name` is how errors refer to it."""
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
        down = self._rs_in.process(a)
        if self._high is not None:
            self._high.push(a, down)
        self._append(down)

    def ready_hops(self) -> int:
        """Input hops queued and not yet taken."""
        return len(self._pending) // self.config.stft.hop

    def take_hop(self) -> np.ndarray:
        """The next input hop as (channels, hop), for `LanePool.step`."""
        hop = self.config.stft.hop
        x, self._pending = self._pending[:hop], self._pending[hop:]
        x = np.ascontiguousarray(x.T)
        if self._level is not None:
            self._level.take(x[:, None])
        return x

    def take_hops(self, n: int) -> np.ndarray:
        """The next n input hops (n <= `ready_hops()`) as (channels, n, hop), for `LanePool.run`."""
        hop = self.config.stft.hop
        if not 0 < n <= self.ready_hops():
            raise ValueError(f"take_hops({n}): {self.ready_hops()} hop(s) ready")
        x, self._pending = self._pending[:n * hop], self._pending[n * hop:]
        x = np.ascontiguousarray(x.reshape(n, hop, self.channels).transpose(2, 0, 1))
        if self._level is not None:
            self._level.take(x)
        return x

    # ------------------------------------------------------------------ results
    def put_output(self, out: np.ndarray, competition=None, activity=None) -> None:
        """One step's result for this stream's lanes: out (channels, hop)."""
        self._ready.append(out.T)
        if self._high is not None:
            self._high.put(out[:, None], None if activity is None else np.asarray(activity)[:, None])
        if self._level is not None:
            self._level.put(out[:, None], None if activity is None else np.asarray(activity)[:, None])
        self.log.record(self.hops_out, competition, activity)
        self.hops_out += 1

    def put_outputs(self, out: np.ndarray, competition=None, activity=None) -> None:
        """The result of `take_hops(n)` run in one call: out (channels, n, hop), competition
        (channels, n, n_tim, n_s) or None, activity (channels, n) or None."""
        n = out.shape[1]
        self._ready.append(out.transpose(1, 2, 0).reshape(-1, self.channels))
        if self._high is not None:
            self._high.put(out, activity)
        if self._level is not None:
            self._level.put(out, activity)
        for t in range(n):
            self.log.record(self.hops_out + t, None if competition is None else competition[:, t],
                            None if activity is None else activity[:, t])
        self.hops_out += n

    def skip(self, k: int) -> tuple[int, int]:
        """Drop the next k ready hops unstepped (their output is zeros, sample alignment is kept).
        Returns (first sample, samples) at the stream's rate of the output that is not its enhanced
        input: the skipped hops, and the audio before them that the model's delay line moves after
        the gap."""
        self.take_hops(k)
        self._ready.append(np.zeros((k * self.config.stft.hop, self.channels), np.float32))
        silent = np.zeros((self.channels, k, self.config.stft.hop), np.float32), np.zeros((self.channels, k), np.float32)
        if self._high is not None:  # no output, no upper band
            self._high.put(*silent)
        if self._level is not None:  # no output, no speech: the gain stays
            self._level.put(*silent)
        first = self.hops_out
        self.hops_out += k
        self.skipped += k
        hop, scale = self.config.stft.hop, self.sample_rate / self.config.stft.sample_rate
        start = round(max(first * hop - self.config.delay_samples, 0) * scale)
        end = round((first + k) * hop * scale)
        return start, end - start

    def pull(self, last: bool = False) -> np.ndarray:
        """Enhanced audio (n, channels) at the stream's rate that is ready, delay removed."""
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
        if self._high is not None:  # the upper band added; samples whose gain is not known yet are held
            y = self._high.apply(y[: max(self.n_in - self.n_out - self._high.held, 0)])
        else:
            y = y[: max(self.n_in - self.n_out, 0)]
        if self._level is not None:
            y = self._level.apply(y, self.n_out)
        self.n_out += y.shape[0]
        return y

    # ------------------------------------------------------------------ the end of the stream
    def begin_flush(self) -> None:
        """Drain the input resampler and pad zeros so that the hops still to run cover every input
        sample plus the model's delay (`ready_hops()` tells how many; skipped hops count as run)."""
        self._check_open()
        down = self._rs_in.process(np.zeros((0, self.channels), np.float32), last=True)
        if self._high is not None:
            self._high.push(np.zeros((0, self.channels), np.float32), down, last=True)
        self._append(down)
        hop = self.config.stft.hop
        need = self.config.delay_samples + self.n_in_model  # model-rate output covering every input sample
        steps = -(-max(need - self.hops_out * hop, 0) // hop)
        missing = steps * hop - len(self._pending)
        if missing > 0:
            self._pending = np.concatenate([self._pending, np.zeros((missing, self.channels), np.float32)])

    def end_flush(self) -> np.ndarray:
        """Once those hops have run: the tail (n, channels), so that the total output length equals
        the total input length. Does not reset the stream."""
        out = self.pull(last=True)
        remaining = self.n_in - self.n_out
        if self._high is not None:
            out = self._high.finish(out, max(remaining, 0))
        else:
            if out.shape[0] < remaining:  # resampler rounding: pad the last sample(s) with zeros
                out = np.concatenate([out, np.zeros((remaining - out.shape[0], self.channels), np.float32)])
            out = out[:max(remaining, 0)]
        if self._level is not None:
            out = self._level.apply(out, self.n_out)
        self.n_out += out.shape[0]
        return out

    def reset(self) -> None:
        """Drop all state and buffered audio: the stream starts afresh on the same lanes."""
        self._check_open()
        self.pool.reset(self.lanes)
        self._clear()

    def close(self) -> None:
        """Give the lanes back to the pool (idempotent)."""
        if not self.closed:
            self.pool.free(self.lanes)
            self.closed = True

    def _append(self, x: np.ndarray) -> None:
        if len(x):
            self.n_in_model += len(x)
            self._pending = np.concatenate([self._pending, x.astype(np.float32, copy=False)])

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("stream is closed")
