"""Full band: the band above the model's 8 kHz, kept for input above 16 kHz (`HighBand`).

The model runs at 16 kHz; its output, resampled back to the stream's rate, holds nothing above
8 kHz. For a stream above 16 kHz the cursor keeps that upper band: the stream-rate input `x`, less
the low band it holds, `up(down(x))`, built from the same downsampled signal the model steps on
and upsampled by a second resampler of the same kind as the output's (so it has the enhanced low
band's alignment, sample for sample):

    high = x - up(down(x))
    out  = up(enhanced) + g(t) * high

`g(t)` follows the model, one value per 16 ms output hop `j` (the model's output at 16 kHz,
after its delay):

* the model's gain in its top bins: the energy ratio of the enhanced to the noisy signal in
  6-7.6 kHz over the 32 ms window that ends with hop `j` (the noisy input is the model's own input
  of the same samples, so this is the gain the model applied there), as an amplitude;
* its speech activity (the step graph's `activity`: the mean gain over 300 Hz..4 kHz): below
  `ACTIVITY_OFF` the hop is a pause and the upper band is closed, above `ACTIVITY_ON` it is open,
  in between a linear ramp;
* smoothed per hop (fast attack, slower release), never below the stream's gain floor
  (`atten_lim_db`), and interpolated linearly per sample at the stream's rate (hop `j`'s value
  is reached at its last sample).

Everything is causal and per hop: `g` for a sample is known as soon as the enhanced low band of
that sample is, so there is no latency beyond the resamplers' and the model's, and the output
does not depend on how the stream was chunked. A skipped hop (the service catching up) has zero
output, so its gain is zero too.
"""
from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .errors import AudioError
from .signal import StreamResampler

BANDS = ("full", "speech")
DEFAULT_BAND = "full"  # above 16 kHz; at 16 kHz and below both bands give the same output

TOP_BAND_HZ = (6000.0, 7600.0)  # the model's top bins whose gain the upper band follows
ACTIVITY_OFF = 0.20  # speech activity at or below which a hop is a pause (upper band closed)
ACTIVITY_ON = 0.45  # ... at or above which the upper band follows the top bins' gain fully
ATTACK = 0.6  # per hop: share of a rise in gain taken at once
RELEASE = 0.35  # per hop: share of a fall in gain taken at once
_EPS = 1e-10  # energy floor of the noisy top band (a silent hop has gain 1 x activity)


def check_band(band) -> str:
    """'full' or 'speech' (AudioError otherwise)."""
    if band not in BANDS:
        raise AudioError(f"band must be one of {', '.join(repr(b) for b in BANDS)}, got {band!r}")
    return band


def uses_high_band(band: str, sample_rate: int, model_rate: int) -> bool:
    """Whether a stream of `band` at `sample_rate` keeps an upper band."""
    return band == "full" and sample_rate > model_rate


def _periodic_hann(n: int) -> np.ndarray:
    return (0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n)).astype(np.float64)


class HighBand:
    """One stream's upper band: its buffers, the reference resampler, and the per-hop gain."""

    def __init__(self, config: ModelConfig, sample_rate: int, channels: int, min_gain: float = 0.0):
        st = config.stft
        self.rate, self.model_rate, self.hop, self.channels = sample_rate, st.sample_rate, st.hop, channels
        self.lookahead_hops = config.delay_samples // st.hop  # output hop j comes out of step j + this
        if config.delay_samples % st.hop:
            raise ValueError("the model's delay must be a whole number of hops")
        self.min_gain = float(min_gain)
        self._rs_ref = StreamResampler(self.model_rate, sample_rate, channels)
        self._x = np.zeros((0, channels), np.float32)  # stream-rate input from sample `_x0` on
        self._r = np.zeros((0, channels), np.float32)  # up(down(x)) from sample `_x0` on
        self._x0 = 0
        self._noisy: list[np.ndarray] = []  # model-rate input hops (channels, hop), hop `_noisy0` first
        self._noisy0 = 0
        self._steps = 0  # model steps put so far
        self._prev_out = np.zeros((channels, st.hop), np.float32)  # the last step's output hop
        self._state = np.zeros(channels, np.float64)  # the smoothed gain
        self._gains: list[np.ndarray] = []  # per output hop (channels,), hop `_g0` first
        self._g0 = 0
        self._g_before = np.zeros(channels, np.float64)  # the gain of hop `_g0 - 1`
        self._window = _periodic_hann(2 * st.hop)
        f = np.fft.rfftfreq(2 * st.hop, 1.0 / st.sample_rate)
        self._top = (f >= TOP_BAND_HZ[0]) & (f <= TOP_BAND_HZ[1])

    # ------------------------------------------------------------------ input
    def push(self, x: np.ndarray, down: np.ndarray, last: bool = False) -> None:
        """Stream-rate input `x` (n, channels) and what the input resampler made of it at the
        model's rate, `down` (m, channels); `last` drains the reference resampler."""
        if len(x):
            self._x = np.concatenate([self._x, x.astype(np.float32, copy=False)])
        r = self._rs_ref.process(down, last=last)
        if len(r):
            self._r = np.concatenate([self._r, r])

    def take(self, hops: np.ndarray) -> None:
        """Model-rate input hops (channels, n, hop) as they go to the model (or are skipped)."""
        self._noisy.extend(np.ascontiguousarray(hops[:, t]) for t in range(hops.shape[1]))

    # ------------------------------------------------------------------ the model's result
    def put(self, out: np.ndarray, activity: np.ndarray | None) -> None:
        """The model's output hops (channels, n, hop) of the next n steps and their activity
        (channels, n) (None: not known, the top bins' gain alone)."""
        n, la, hop = out.shape[1], self.lookahead_hops, self.hop
        prev = np.concatenate([self._prev_out[:, None], out], axis=1)  # (c, n + 1, hop)
        self._prev_out = out[:, -1].copy()
        first = self._steps
        self._steps += n
        ts = [t for t in range(n) if first + t >= la]  # steps whose output hop is audio, not delay
        if not ts:
            return
        zeros = np.zeros((self.channels, hop), np.float32)
        noisy = np.stack([self._noisy_hop(first + t - la + k, zeros) for t in ts for k in (-1, 0)], axis=1)
        enh = np.stack([prev[:, t + k] for t in ts for k in (0, 1)], axis=1)
        c = self.channels
        e_frames = enh.reshape(c, len(ts), 2 * hop).astype(np.float64)
        n_frames = noisy.reshape(c, len(ts), 2 * hop).astype(np.float64)
        pe = (np.abs(np.fft.rfft(e_frames * self._window, axis=-1))[..., self._top] ** 2).sum(-1)
        pn = (np.abs(np.fft.rfft(n_frames * self._window, axis=-1))[..., self._top] ** 2).sum(-1)
        top_gain = np.minimum(np.sqrt((pe + _EPS) / (pn + _EPS)), 1.0)  # (c, len(ts))
        if activity is None:
            speech = np.ones_like(top_gain)
        else:
            a = np.asarray(activity, np.float64)[:, ts]
            speech = np.clip((a - ACTIVITY_OFF) / (ACTIVITY_ON - ACTIVITY_OFF), 0.0, 1.0)
        target = top_gain * speech
        for i in range(len(ts)):
            g = target[:, i]
            rate = np.where(g > self._state, ATTACK, RELEASE)
            self._state = self._state + rate * (g - self._state)
            self._gains.append(self._state.copy())
        self._drop_noisy(first + n - la - 1)

    def _noisy_hop(self, j: int, zeros: np.ndarray) -> np.ndarray:
        if j < 0:
            return zeros
        return self._noisy[j - self._noisy0]

    def _drop_noisy(self, keep_from: int) -> None:
        k = max(0, keep_from - self._noisy0)
        if k:
            del self._noisy[:k]
            self._noisy0 += k

    # ------------------------------------------------------------------ output
    def apply(self, y: np.ndarray, start: int) -> np.ndarray:
        """The enhanced low band y (m, channels) of stream samples [start, start + m) with the
        gained upper band added; consumes those samples."""
        m = len(y)
        if not m:
            return y
        if start != self._x0:
            raise RuntimeError(f"upper band at sample {self._x0}, output at {start}")
        x = self._x[:m]
        r = self._r[:m]
        high = np.zeros((m, self.channels), np.float32)
        k = min(len(x), len(r))  # only at the very end can the reference fall short (then no upper band)
        high[:k] = x[:k] - r[:k]
        g = self._gain_per_sample(start, m)
        out = (y + g * high).astype(np.float32, copy=False)
        self._x, self._r = self._x[m:], self._r[m:]
        self._x0 += m
        return out

    def _gain_per_sample(self, start: int, m: int) -> np.ndarray:
        """(m, channels): hop j's gain at its last model-rate sample, linear in between."""
        s = np.arange(start, start + m, dtype=np.int64)
        num, den = s * self.model_rate, self.rate * self.hop
        j = num // den
        frac = ((num - j * den) / den)[:, None]
        if self._gains:
            table = np.concatenate([self._g_before[None], np.stack(self._gains)])  # hops _g0 - 1 ...
        else:
            table = self._g_before[None]
        last = len(table) - 1
        hi = np.clip(j - self._g0 + 1, 0, last)  # hop j (clamped: the tail past the last step)
        lo = np.clip(j - self._g0, 0, last)  # hop j - 1
        g = np.maximum(table[lo] * (1.0 - frac) + table[hi] * frac, self.min_gain)
        # the gains before the next sample's hop are no longer needed
        nxt = ((start + m) * self.model_rate) // den
        drop = min(max(nxt - self._g0, 0), len(self._gains))
        if drop:
            self._g_before = self._gains[drop - 1]
            del self._gains[:drop]
            self._g0 += drop
        return g.astype(np.float32)
