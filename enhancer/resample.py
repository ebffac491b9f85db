"""Stream resampling with a short, fixed delay: a polyphase FIR, sample for sample (`StreamResampler`).

A stream at another rate than the model's passes through two resamplers (in and out) and, with the
upper band, a third. Each is a linear-phase low-pass (a Kaiser-windowed sinc, `ATTEN_DB` down from
the lower rate's Nyquist frequency on, flat to `PASS` of it) in polyphase form: output sample n is
the dot product of the input around n * from_rate / to_rate with one of the filter's phases. Its
group delay is compensated (output sample n is the input's time n / to_rate), so what a stream
waits for it is the filter's half length, `delay_ms`: 6.7 ms between 16 kHz and any higher rate,
13.4 ms to and from 8 kHz (the transition band is a share of the lower Nyquist frequency).

The filter runs as matrix products: a period of the ratio's output samples is one row (its input
window) times one matrix, a few rows at a time, in blocks of a fixed shape at fixed output
positions, so each output sample's arithmetic does not depend on how the input was chunked: every
chunking gives the same samples bit for bit. The state is the counts and the input from the first
sample the next output takes (`state`, `load_state`), so a stream continued in another process
gives what it would have given.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

ATTEN_DB = 100.0  # stop-band attenuation
PASS = 0.94  # the pass band's edge, a share of the lower rate's Nyquist frequency (the stop band starts at it)
MAX_MATRIX = 1 << 22  # elements of a period's matrix, at most: rates without a short period are filtered directly
TABLE_STEPS = 512  # the direct filter's table: points per input sample (linear interpolation between them)
MIN_PERIOD = 32  # output samples per row of the product, at least
BLOCK_S = 0.008  # output per matrix product (its rows), about


def _sizes(from_rate: int, to_rate: int) -> tuple[int, int, int, int, float]:
    """(L, M, delay D in output samples, the filter's centre at its rate, cutoff Hz) of the filter
    from `from_rate` to `to_rate` = from_rate * L / M in lowest terms."""
    g = math.gcd(from_rate, to_rate)
    up, down = to_rate // g, from_rate // g
    nyq = 0.5 * min(from_rate, to_rate)
    width = nyq * (1.0 - PASS)  # transition band, Hz
    # Kaiser's estimate of the length for ATTEN_DB over that transition, at the filter's rate from_rate * L
    n = (ATTEN_DB - 7.95) / (2.285 * 2.0 * math.pi * width / (from_rate * up))
    delay = max(1, math.ceil(n / (2 * down)))  # half length, in output samples (a whole number of them)
    return up, down, delay, delay * down, nyq - 0.5 * width


def _direct(from_rate: int, to_rate: int) -> bool:
    """Whether the ratio's period is too long for one matrix per period (coprime rates such as 65537 Hz)."""
    up, down, _, center, _ = _sizes(from_rate, to_rate)
    taps = -(-(2 * center + 1) // up)
    per_out = up * -(-MIN_PERIOD // up)
    span = (per_out - 1) * down // up + taps + 1
    return up * taps > MAX_MATRIX or span * per_out > MAX_MATRIX


def _kaiser_sinc(u: np.ndarray, half: float, cutoff: float, rate: float) -> np.ndarray:
    """The filter's taps at offsets u (in samples of `rate`) from its centre, half length `half`."""
    beta = 0.1102 * (ATTEN_DB - 8.7)
    x = np.clip(u / half, -1.0, 1.0)
    w = np.where(np.abs(u) <= half, np.i0(beta * np.sqrt(1.0 - x * x)) / np.i0(beta), 0.0)
    return (2.0 * cutoff / rate) * np.sinc(2.0 * cutoff * u / rate) * w


@functools.lru_cache(maxsize=8)
def _table(from_rate: int, to_rate: int) -> tuple[int, np.ndarray]:
    """(K, table): the direct filter reaches K input samples either side of an output's time;
    table[i] is its tap at i / TABLE_STEPS - K input samples from it (float32)."""
    up, _, _, center, cutoff = _sizes(from_rate, to_rate)
    half = center / up  # in input samples
    k = math.ceil(half)
    u = np.arange(-k * TABLE_STEPS, k * TABLE_STEPS + 2) / TABLE_STEPS
    return k, _kaiser_sinc(u, half, cutoff, from_rate).astype(np.float32)


def _design(from_rate: int, to_rate: int) -> tuple[int, int, int, int, np.ndarray]:
    """(L, M, T, D, phases): to_rate = from_rate * L / M in lowest terms; T taps per phase; the
    delay D in output samples; phases (L, T) float64, phase p's taps oldest input first."""
    up, down, delay, center, cutoff = _sizes(from_rate, to_rate)
    hi = from_rate * up  # the filter's rate (the input with L - 1 zeros between samples)
    taps = -(-(2 * center + 1) // up)  # per phase
    k = np.arange(2 * center + 1, dtype=np.float64) - center
    h = np.zeros(taps * up)
    h[:2 * center + 1] = _kaiser_sinc(k, center, cutoff, hi) * up
    # output m (delay included) takes input floor(m M / L) - t with tap p + L t, p = m M mod L
    return up, down, taps, delay, np.ascontiguousarray(h.reshape(taps, up).T[:, ::-1])


class _Plan(NamedTuple):
    """The filter as one matrix per period: `per_out` consecutive output samples (from a multiple
    of it) take the `span` input samples from `per_in` times the period's index plus `offset`,
    times `matrix` (span, per_out); `rows` periods at a time (`BLOCK_S` of output)."""
    per_in: int
    per_out: int
    offset: int
    span: int
    rows: int
    delay: int
    matrix: np.ndarray


@functools.lru_cache(maxsize=32)
def _plan(from_rate: int, to_rate: int) -> _Plan:
    up, down, taps, delay, phases = _design(from_rate, to_rate)
    g = -(-MIN_PERIOD // up)  # whole periods of the ratio per row
    per_in, per_out = down * g, up * g
    m = (np.arange(per_out) + delay) * down
    first = m // up - (taps - 1)  # each output's oldest input sample, from the period's start
    span = int(first[-1] - first[0]) + taps
    matrix = np.zeros((span, per_out))
    for j in range(per_out):
        matrix[first[j] - first[0]:first[j] - first[0] + taps, j] = phases[m[j] % up]
    rows = max(1, round(BLOCK_S * to_rate / per_out))
    return _Plan(per_in, per_out, int(first[0]), span, rows, delay, matrix.astype(np.float32))


def delay_ms(from_rate: int, to_rate: int) -> float:
    """What a sample waits in the resampler from `from_rate` to `to_rate` (0 for the same rate)."""
    if from_rate == to_rate:
        return 0.0
    if _direct(from_rate, to_rate):
        return 1000.0 * _table(from_rate, to_rate)[0] / from_rate
    return 1000.0 * _sizes(from_rate, to_rate)[2] / to_rate


def round_trip_ms(rate: int, model_rate: int) -> float:
    """What a stream at `rate` waits in the resamplers to `model_rate` and back (0 at the same rate)."""
    return delay_ms(rate, model_rate) + delay_ms(model_rate, rate)


def output_length(n_in: int, from_rate: int, to_rate: int) -> int:
    """Samples out for n_in in: n_in * to_rate / from_rate, rounded."""
    return (2 * n_in * to_rate + from_rate) // (2 * from_rate)


class StreamResampler:
    """Chunked resampler of (n, channels) float32 audio from `from_rate` to `to_rate`.

    `process(x)` returns every output sample whose input is known (the filter's delay ahead);
    `process(x, last=True)` ends the stream: the input continues as zeros, and the output totals
    the input's length times the ratio, rounded."""

    def __init__(self, from_rate: int, to_rate: int, channels: int):
        self.from_rate, self.to_rate, self.channels = from_rate, to_rate, channels
        self.identity = from_rate == to_rate
        self.n_in = self.n_out = 0  # samples taken and given since the start
        if not self.identity:
            self._direct = _direct(from_rate, to_rate)
            if self._direct:
                self._reach, self._table = _table(from_rate, to_rate)
            else:
                self._plan = _plan(from_rate, to_rate)
            self._x = np.zeros((channels, self.n_in - self._start(0)), np.float32)  # input from `_start(n_out)` on

    def _start(self, n_out: int) -> int:
        """The first input sample the output from `n_out` on takes (the start of its period's window)."""
        if self._direct:
            return n_out * self.from_rate // self.to_rate - self._reach + 1
        p = self._plan
        return n_out // p.per_out * p.per_in + p.offset

    def _ready(self, n_in: int) -> int:
        """Output samples whose input is all among the first n_in input samples."""
        if self._direct:
            k = self._reach
            return ((n_in - k) * self.to_rate - 1) // self.from_rate + 1 if n_in > k else 0
        p = self._plan
        return (n_in * p.per_out - 1) // p.per_in + 1 - p.delay if n_in else 0

    def process(self, x: np.ndarray, last: bool = False) -> np.ndarray:
        if self.identity:
            self.n_in += len(x)
            self.n_out += len(x)
            return x
        c = self.channels
        x = np.asarray(x, np.float32).reshape(-1, c)
        n_in = self.n_in + len(x)
        if last:  # up to the rounded total; the input beyond its end is zeros
            end = output_length(n_in, self.from_rate, self.to_rate)
        else:  # every output sample whose last input sample is here
            end = self._ready(n_in)
        end = max(end, self.n_out)
        x0 = self._start(self.n_out)
        data = np.concatenate([self._x, x.T], axis=1)  # input from x0 on
        if end > self.n_out and self._direct:
            y = self._filter_direct(data, x0, self.n_out, end)
        elif end > self.n_out:
            p = self._plan
            per_block = p.rows * p.per_out
            b0, b1 = self.n_out // per_block, -(-end // per_block)  # the output blocks to compute
            y = self._blocks(data, x0, b0, b1)[:, self.n_out - b0 * per_block:end - b0 * per_block].T
        else:
            y = np.zeros((0, c), np.float32)
        self.n_in, self.n_out = n_in, end
        self._x = data[:, self._start(end) - x0:].copy()  # not a view that keeps all of `data`
        return np.ascontiguousarray(y)

    def _filter_direct(self, data: np.ndarray, x0: int, start: int, end: int, batch: int = 1024) -> np.ndarray:
        """Output samples start .. end - 1 (n, channels), each from its own taps (the table, linearly
        interpolated at its time); data[:, i] is input sample x0 + i, zeros beyond it."""
        k, steps, c = self._reach, TABLE_STEPS, data.shape[0]
        need = (end - 1) * self.from_rate // self.to_rate + k + 1 - x0  # samples of data the last output takes
        if need > data.shape[1]:
            data = np.concatenate([data, np.zeros((c, need - data.shape[1]), np.float32)], axis=1)
        out, j = [], np.arange(2 * k)
        for a in range(start, end, batch):
            n = np.arange(a, min(a + batch, end), dtype=np.int64) * self.from_rate
            q, frac = n // self.to_rate, (n % self.to_rate) / self.to_rate
            pos = (frac[:, None] + (2 * k - 1) - j) * steps  # (n, 2k): where each tap lies in the table
            i = pos.astype(np.int64)
            w = (pos - i).astype(np.float32)
            taps = self._table[i] * (1 - w) + self._table[i + 1] * w
            idx = (q - k + 1 - x0)[:, None] + j
            y = np.empty((len(n), c), np.float32)
            for ch in range(c):  # (n, 2k) products summed along their rows, the same for any channel count
                y[:, ch] = (data[ch][idx] * taps).sum(-1)
            out.append(y)
        return np.concatenate(out)

    def _blocks(self, data: np.ndarray, x0: int, b0: int, b1: int) -> np.ndarray:
        """Output blocks b0 .. b1 - 1 (channels, (b1 - b0) * rows * per_out); data[:, i] is input
        sample x0 + i, zeros outside it."""
        p, c = self._plan, data.shape[0]
        step = p.rows * p.per_in  # input samples per block
        lo = b0 * step + p.offset  # the first block's first input sample
        seg = np.zeros((c, (b1 - b0 - 1) * step + (p.rows - 1) * p.per_in + p.span), np.float32)
        a, z = max(lo, x0), min(lo + seg.shape[1], x0 + data.shape[1])
        if z > a:
            seg[:, a - lo:z - lo] = data[:, a - x0:z - x0]
        out = np.empty((c, b1 - b0, p.rows * p.per_out), np.float32)
        shape, strides = (p.rows, p.span), (4 * p.per_in, 4)
        for ch in range(c):
            s = seg[ch]
            for b in range(b1 - b0):  # one product of the same shape per block and channel
                rows = np.ndarray(shape, np.float32, s, 4 * b * step, strides).copy()
                out[ch, b] = (rows @ p.matrix).reshape(-1)
        return out.reshape(c, -1)

    def state(self) -> dict:
        """What rebuilds this resampler elsewhere (`load_state`): the counts and the input from
        the first sample the next output takes."""
        if self.identity:
            return {"n_in": self.n_in, "n_out": self.n_out}
        return {"n_in": self.n_in, "n_out": self.n_out, "tail": np.ascontiguousarray(self._x.T)}

    def load_state(self, state: dict) -> None:
        """Continue where the resampler whose `state()` this is stopped (same rates and channels):
        its next output samples are the ones that one would have given next."""
        n_in, n_out = int(state["n_in"]), int(state["n_out"])
        if not self.identity:
            tail = np.asarray(state["tail"], np.float32)
            want = (n_in - self._start(n_out), self.channels)
            if n_in < 0 or n_out < 0 or tail.shape != want:
                raise ValueError(f"the resampler's state holds {tail.shape} input samples and channels for "
                                 f"{n_out} out of {n_in} in, {want} are needed: not a state of this one")
            self._x = np.ascontiguousarray(tail.T)
        self.n_in, self.n_out = n_in, n_out
