"""Signal path in numpy: windows, STFT/iSTFT, log-magnitude features, resampling, input checks.

The torch twins live in `enhancer.build.model.features`; a test holds them equal. Framing convention
(shared with the streaming step): the signal is preceded by one hop of zeros, frame `n` covers
padded samples `[n*hop, n*hop + n_fft)`, so frame 0 holds one hop of zeros and the first hop.
"""
from __future__ import annotations

import math

import numpy as np

from .config import STFTConfig
from .errors import AudioError

MIN_RATE = 1000
MAX_RATE = 384000
# Float audio is expected in about [-1, 1] (full scale). Finite samples far beyond it still break
# the model: from about 1e17 its output overflows to NaN/Inf. The service uses the same bound.
MAX_ABS_SAMPLE = 1e6
REPLAY_SAMPLES = 4096  # input samples a rebuilt stream resampler replays per unit of its decimation (`StreamResampler`)
MAX_CHANNELS = 64  # channels of one signal or stream (the service's max_channels is at most this)


def sqrt_hann(n: int) -> np.ndarray:
    """Periodic sqrt-Hann window; its square sums to exactly 1 at 50 % overlap."""
    return np.sqrt(0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n)).astype(np.float32)


def n_frames_for(n_samples: int, cfg: STFTConfig = STFTConfig()) -> int:
    """Frames needed so that every input sample is covered by two frames (fully reconstructed)."""
    return -(-n_samples // cfg.hop) + 1


def pad_for_stft(x: np.ndarray, n_frames: int, cfg: STFTConfig = STFTConfig()) -> np.ndarray:
    """One hop of zeros in front, zeros at the end up to `n_frames` frames. x: (..., n)."""
    total = (n_frames + 1) * cfg.hop
    end = total - cfg.hop - x.shape[-1]
    if end < 0:
        raise ValueError("n_frames too small for the signal")
    widths = [(0, 0)] * (x.ndim - 1) + [(cfg.hop, end)]
    return np.pad(x, widths)


def stft(x: np.ndarray, cfg: STFTConfig = STFTConfig(), n_frames: int | None = None) -> np.ndarray:
    """x: (..., n) float -> complex64 (..., frames, n_freqs)."""
    x = np.asarray(x, dtype=np.float32)
    n_frames = n_frames_for(x.shape[-1], cfg) if n_frames is None else n_frames
    xp = pad_for_stft(x, n_frames, cfg)
    idx = np.arange(n_frames)[:, None] * cfg.hop + np.arange(cfg.n_fft)[None, :]
    frames = xp[..., idx] * sqrt_hann(cfg.n_fft)  # (..., T, n_fft)
    return np.fft.rfft(frames, axis=-1).astype(np.complex64)


def istft(spec: np.ndarray, n_samples: int, cfg: STFTConfig = STFTConfig()) -> np.ndarray:
    """Inverse of `stft`: complex (..., T, F) -> float32 (..., n_samples)."""
    frames = np.fft.irfft(spec, n=cfg.n_fft, axis=-1).astype(np.float32) * sqrt_hann(cfg.n_fft)
    t = frames.shape[-2]
    out = np.zeros(frames.shape[:-2] + ((t + 1) * cfg.hop,), dtype=np.float32)
    # 50 % overlap: frames i, i+2, i+4 ... start at (i + 2k) * hop and are 2 * hop long, so each
    # parity class tiles the output back to back and is added with one reshape.
    for i in range(2):
        part = frames[..., i::2, :]
        n = part.shape[-2] * cfg.n_fft
        out[..., i * cfg.hop:i * cfg.hop + n] += part.reshape(part.shape[:-2] + (n,))
    return out[..., cfg.hop:cfg.hop + n_samples]


def log_magnitude(spec: np.ndarray, eps: float) -> np.ndarray:
    """log(|X| + eps), float32."""
    return np.log(np.abs(spec) + eps).astype(np.float32)


# --------------------------------------------------------------------------- input handling
def nonfinite_and_peak(x: np.ndarray) -> tuple[int, float]:
    """(number of NaN/Inf samples, peak |x|) of non-empty float audio, in one pass when all samples
    are finite (the peak is meaningless otherwise)."""
    peak = float(np.abs(x).max())
    if math.isfinite(peak):
        return 0, peak
    return int((~np.isfinite(x)).sum()), peak


def check_audio(audio: np.ndarray, name: str = "audio") -> np.ndarray:
    """Validate a waveform: shape (n,) or (n, channels), finite, within +-MAX_ABS_SAMPLE, non-empty.
    Returns float32."""
    a = np.asarray(audio)
    if a.dtype.kind not in "fiu":
        raise AudioError(f"{name}: expected a numeric array, got dtype {a.dtype}")
    if a.ndim not in (1, 2):
        raise AudioError(f"{name}: expected shape (samples,) or (samples, channels), got {a.shape}")
    if a.shape[0] == 0:
        raise AudioError(f"{name}: empty audio (0 samples)")
    if a.ndim == 2 and a.shape[1] == 0:
        raise AudioError(f"{name}: 0 channels")
    if a.ndim == 2 and a.shape[1] > MAX_CHANNELS:
        raise AudioError(f"{name}: {a.shape[1]} channels; is the array transposed? expected (samples, channels)")
    a = to_float32(a)
    bad, peak = nonfinite_and_peak(a)
    if bad:
        raise AudioError(f"{name}: {bad} sample(s) are NaN or Inf")
    if peak > MAX_ABS_SAMPLE:
        raise AudioError(f"{name}: sample values up to {peak:.3g}; float audio is expected in about [-1, 1] "
                         f"and must lie within +-{MAX_ABS_SAMPLE:g}")
    return a


def to_float32(a: np.ndarray) -> np.ndarray:
    """Integer PCM is scaled to [-1, 1); floats are cast."""
    if a.dtype.kind == "f":
        return a.astype(np.float32, copy=False)
    if a.dtype.kind == "u":  # unsigned 8-bit PCM is offset binary
        bits = a.dtype.itemsize * 8
        return ((a.astype(np.float32) - 2 ** (bits - 1)) / 2 ** (bits - 1)).astype(np.float32)
    bits = a.dtype.itemsize * 8
    return (a.astype(np.float32) / 2 ** (bits - 1)).astype(np.float32)


def check_rate(sample_rate: int) -> int:
    try:
        sr = int(sample_rate)
    except (TypeError, ValueError, OverflowError):
        raise AudioError(f"sample rate must be an integer, got {sample_rate!r}") from None
    if sr != sample_rate or not MIN_RATE <= sr <= MAX_RATE:
        raise AudioError(f"sample rate {sample_rate!r} Hz is outside the supported {MIN_RATE}..{MAX_RATE} Hz")
    return sr


def resample(x: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """High-quality resampling (libsoxr, VHQ) of (n,) or (n, channels) float32 audio."""
    if from_rate == to_rate:
        return x
    import soxr

    return soxr.resample(x, from_rate, to_rate, quality="VHQ").astype(np.float32, copy=False)


class StreamResampler:
    """Chunked resampler for streams (libsoxr keeps its own state between chunks).

    libsoxr's state cannot be read out, so a stream that moves to another process carries what
    rebuilds it instead (`state`, `load_state`): the counts of samples in and out and the last input
    samples. A new resampler fed that tail from a sample whose position is a whole number of the
    rates' periods gives, after its filter's length, exactly the samples the old one would have given
    (the filter sees the same input at the same phase); the samples it gives before them, or beyond
    what the old one had given, are dropped or handed out first so that the output continues where
    it stopped."""

    def __init__(self, from_rate: int, to_rate: int, channels: int):
        self.from_rate, self.to_rate, self.channels = from_rate, to_rate, channels
        self.identity = from_rate == to_rate
        self.n_in = self.n_out = 0  # samples taken and given since the start
        if not self.identity:
            self._rs = self._new()
            self._period = from_rate // math.gcd(from_rate, to_rate)  # input samples per whole output sample
            self._warm = REPLAY_SAMPLES * (1 + -(-from_rate // to_rate) // 2)  # the filter's reach, with margin
            self.history = self._warm + self._period  # input samples kept for `state`
            self._tail = np.zeros((2 * self.history, channels), np.float32)
            self._tail_end = 0  # the kept input is _tail[max(_tail_end - history, 0):_tail_end]
            self._skip = 0  # output samples to drop (a rebuilt resampler's before the old one's next)
            self._early = np.zeros((0, channels), np.float32)  # output to give first (a rebuilt one's extra)

    def _new(self):
        import soxr

        return soxr.ResampleStream(self.from_rate, self.to_rate, self.channels, dtype="float32", quality="VHQ")

    def process(self, x: np.ndarray, last: bool = False) -> np.ndarray:
        if self.identity:
            self.n_in += len(x)
            self.n_out += len(x)
            return x
        x = np.ascontiguousarray(x, dtype=np.float32)
        self._keep(x)
        y = self._rs.resample_chunk(x, last=last)
        if self._skip:
            k = min(self._skip, len(y))
            y, self._skip = y[k:], self._skip - k
        if len(self._early):
            y, self._early = np.concatenate([self._early, y]), self._early[:0]
        self.n_in += len(x)
        self.n_out += len(y)
        return y

    def _keep(self, x: np.ndarray) -> None:
        n, h = len(x), self.history
        if n >= h:
            self._tail[:h], self._tail_end = x[n - h:], h
            return
        if self._tail_end + n > len(self._tail):  # move the last `h - n` kept samples to the front
            keep = min(self._tail_end, h - n)
            self._tail[:keep] = self._tail[self._tail_end - keep:self._tail_end]
            self._tail_end = keep
        self._tail[self._tail_end:self._tail_end + n] = x
        self._tail_end += n

    def state(self) -> dict:
        """What rebuilds this resampler elsewhere (`load_state`): the counts and the kept input."""
        if self.identity:
            return {"n_in": self.n_in, "n_out": self.n_out}
        k = min(self.n_in, self.history)
        return {"n_in": self.n_in, "n_out": self.n_out, "tail": self._tail[self._tail_end - k:self._tail_end].copy()}

    def load_state(self, state: dict) -> None:
        """Continue where the resampler whose `state()` this is stopped (same rates and channels):
        its next output samples are the ones that one would have given next."""
        n_in, n_out = int(state["n_in"]), int(state["n_out"])
        if not self.identity:
            tail = np.ascontiguousarray(state["tail"], np.float32).reshape(-1, self.channels)
            # replay from a whole number of periods before the end, as far back as the filter reaches
            h = n_in if n_in <= self._warm else self._warm + (n_in - self._warm) % self._period
            if h > len(tail):
                raise ValueError(f"the resampler's state holds {len(tail)} input samples, {h} are needed")
            first = n_in - h  # a multiple of the period (or 0): where its output starts is exact
            self._rs, self._tail_end = self._new(), 0
            replay = self._rs.resample_chunk(np.ascontiguousarray(tail[len(tail) - h:]))
            self._keep(tail)
            given = n_out - first * self.to_rate // self.from_rate  # of the replay's output: given already
            if given < 0:
                raise ValueError(f"the resampler's state gave {n_out} samples for {n_in}: not a state of this one")
            self._skip = max(given - len(replay), 0)
            self._early = replay[max(given, 0):]
        self.n_in, self.n_out = n_in, n_out
