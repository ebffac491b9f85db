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
ACTIVITY_ON = 0.45  # ... at or above which the upper band is fully open
PRESENCE_HOPS = 125  # the enhanced low band's floor: the minimum of its smoothed level over ~2 s
PRESENCE_DB = (10.0, 20.0)  # enhanced low band above that floor: closed at or below, fully open at or above
PRESENCE_FLOOR = 1e-9  # the floor is never below -90 dB (re a full-scale sine's frame energy)
NOISE_HOPS = 60  # the upper band's noise floor: the minimum of its smoothed level over ~1 s
NOISE_SMOOTH = 0.7  # per hop: weight of the past in that smoothed level
NOISE_BIAS = 2.0  # the minimum underestimates the mean noise level by about this factor
OVER = 1.0  # noise subtraction factor of the upper band's own gain
USE_TOP = False  # also let the model's top-bin gain open the upper band
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
    """One stream's upper band: its buffers, the reference resampler, and the per-hop gain.

    The cursor hands it the stream's input (`push`), the hops going to the model (`take`), the
    model's results (`put`) and the enhanced low band at the stream's rate (`apply`, `finish`),
    which it returns with the gained upper band added, as far as the gains are known."""

    def __init__(self, config: ModelConfig, sample_rate: int, channels: int, min_gain: float = 0.0):
        st = config.stft
        self.rate, self.model_rate, self.hop, self.channels = sample_rate, st.sample_rate, st.hop, channels
        if config.delay_samples % st.hop:
            raise ValueError("the model's delay must be a whole number of hops")
        self.lookahead_hops = config.delay_samples // st.hop  # output hop j comes out of step j + this
        self.min_gain = float(min_gain)
        c = channels
        self._rs_ref = StreamResampler(self.model_rate, sample_rate, c)
        self._x = np.zeros((0, c), np.float32)  # stream-rate input not yet in `_h`
        self._r = np.zeros((0, c), np.float32)  # up(down(x)) not yet in `_h`
        self._h = np.zeros((0, c), np.float32)  # the upper band x - up(down(x)) from sample `_h0` on
        self._h0 = 0
        self._drained = False  # the reference resampler has been drained: `_h` is complete
        self._y = np.zeros((0, c), np.float32)  # enhanced low band from sample `_out0` on, held
        self._out0 = 0  # the next output sample
        self._noisy: list[np.ndarray] = []  # model-rate input hops (channels, hop), hop `_noisy0` first
        self._noisy0 = 0
        self._steps = 0  # model steps put so far
        self._prev_out = np.zeros((c, st.hop), np.float32)  # the last step's output hop
        self._model: list[np.ndarray] = []  # per output hop from `_next` on: (top-bin gain, speech) (2, c)
        self._next = 0  # the next output hop whose gain is to be computed
        self._level = np.zeros(c, np.float64)  # smoothed upper-band level
        self._lb_level = np.zeros(c, np.float64)  # smoothed enhanced low-band level
        self._lb_levels: list[np.ndarray] = []  # its last PRESENCE_HOPS values
        self._levels: list[np.ndarray] = []  # its last NOISE_HOPS values
        self._state = np.zeros(c, np.float64)  # the smoothed gain
        self._gains: list[np.ndarray] = []  # per output hop (channels,), hop `_g0` first
        self._g0 = 0
        self._g_before = np.zeros(c, np.float64)  # the gain of hop `_g0 - 1`
        self._window = _periodic_hann(2 * st.hop)
        f = np.fft.rfftfreq(2 * st.hop, 1.0 / st.sample_rate)
        self._top = (f >= TOP_BAND_HZ[0]) & (f <= TOP_BAND_HZ[1])

    @property
    def held(self) -> int:
        """Enhanced low-band samples held until their gain is known."""
        return len(self._y)

    def _at(self, t: int) -> int:
        """The stream sample at model-rate sample t (rounded up)."""
        return -(-t * self.rate // self.model_rate)

    # ------------------------------------------------------------------ input
    def push(self, x: np.ndarray, down: np.ndarray, last: bool = False) -> None:
        """Stream-rate input `x` (n, channels) and what the input resampler made of it at the
        model's rate, `down` (m, channels); `last` drains the reference resampler."""
        if len(x):
            self._x = np.concatenate([self._x, x.astype(np.float32, copy=False)])
        r = self._rs_ref.process(down, last=last)
        if len(r):
            self._r = np.concatenate([self._r, r])
        k = min(len(self._x), len(self._r))
        if k:
            self._h = np.concatenate([self._h, self._x[:k] - self._r[:k]])
            self._x, self._r = self._x[k:], self._r[k:]
        if last:  # the input past the reference's end has no upper band
            self._drained = True

    def take(self, hops: np.ndarray) -> None:
        """Model-rate input hops (channels, n, hop) as they go to the model (or are skipped)."""
        self._noisy.extend(np.ascontiguousarray(hops[:, t]) for t in range(hops.shape[1]))

    # ------------------------------------------------------------------ the model's result
    def put(self, out: np.ndarray, activity: np.ndarray | None) -> None:
        """The model's output hops (channels, n, hop) of the next n steps and their activity
        (channels, n) (None: not known, taken as speech)."""
        n, la, hop, c = out.shape[1], self.lookahead_hops, self.hop, self.channels
        prev = np.concatenate([self._prev_out[:, None], out], axis=1)  # (c, n + 1, hop)
        self._prev_out = out[:, -1].copy()
        first = self._steps
        self._steps += n
        ts = [t for t in range(n) if first + t >= la]  # steps whose output hop is audio, not delay
        if not ts:
            return
        zeros = np.zeros((c, hop), np.float32)
        noisy = np.stack([self._noisy_hop(first + t - la + k, zeros) for t in ts for k in (-1, 0)], axis=1)
        enh = np.stack([prev[:, t + k] for t in ts for k in (0, 1)], axis=1)
        e_frames = enh.reshape(c, len(ts), 2 * hop).astype(np.float64)
        n_frames = noisy.reshape(c, len(ts), 2 * hop).astype(np.float64)
        pe_all = np.abs(np.fft.rfft(e_frames * self._window, axis=-1)) ** 2
        pe = pe_all[..., self._top].sum(-1)
        enhanced_level = pe_all.mean(-1)  # (c, len(ts))
        pn = (np.abs(np.fft.rfft(n_frames * self._window, axis=-1))[..., self._top] ** 2).sum(-1)
        top_gain = np.minimum(np.sqrt((pe + _EPS) / (pn + _EPS)), 1.0)  # (c, len(ts))
        if activity is None:
            speech = np.ones_like(top_gain)
        else:
            a = np.asarray(activity, np.float64)[:, ts]
            speech = np.clip((a - ACTIVITY_OFF) / (ACTIVITY_ON - ACTIVITY_OFF), 0.0, 1.0)
        for i in range(len(ts)):  # the enhanced low band against its own floor: is there speech at all?
            lv = enhanced_level[:, i]
            self._lb_level = lv if first + ts[i] == la else NOISE_SMOOTH * self._lb_level + (1 - NOISE_SMOOTH) * lv
            self._lb_levels.append(self._lb_level)
            if len(self._lb_levels) > PRESENCE_HOPS:
                self._lb_levels.pop(0)
            floor = np.maximum(np.min(self._lb_levels, axis=0), PRESENCE_FLOOR * (2 * hop) / 4)
            db = 10.0 * np.log10(np.maximum(self._lb_level, 1e-30) / floor)
            presence = np.clip((db - PRESENCE_DB[0]) / (PRESENCE_DB[1] - PRESENCE_DB[0]), 0.0, 1.0)
            self._model.append(np.stack([top_gain[:, i], speech[:, i] * presence]))
        self._drop_noisy(first + n - la - 1)

    def _noisy_hop(self, j: int, zeros: np.ndarray) -> np.ndarray:
        return zeros if j < 0 else self._noisy[j - self._noisy0]

    def _drop_noisy(self, keep_from: int) -> None:
        k = max(0, keep_from - self._noisy0)
        if k:
            del self._noisy[:k]
            self._noisy0 += k

    def _advance(self) -> None:
        """The gains of every output hop whose model result and upper band are both there: hop
        j's upper-band level is taken over model-rate samples [(j-1) hop, (j+1) hop)."""
        hop = self.hop
        while self._model:
            j = self._next
            a, b = max(self._at((j - 1) * hop), 0), self._at((j + 1) * hop)
            if b > self._h0 + len(self._h) and not self._drained:
                return
            seg = self._h[a - self._h0:b - self._h0].astype(np.float64)
            level = (seg ** 2).sum(0) / max(b - a, 1)
            top_gain, speech = self._model.pop(0)
            self._next += 1
            self._level = level if j == 0 else NOISE_SMOOTH * self._level + (1 - NOISE_SMOOTH) * level
            self._levels.append(self._level)
            if len(self._levels) > NOISE_HOPS:
                self._levels.pop(0)
            noise = NOISE_BIAS * np.min(self._levels, axis=0)
            own = np.sqrt(np.clip(1.0 - OVER * noise / np.maximum(level, 1e-20), 0.0, 1.0))
            target = speech * (np.maximum(own, top_gain) if USE_TOP else own)
            rate = np.where(target > self._state, ATTACK, RELEASE)
            self._state = self._state + rate * (target - self._state)
            self._gains.append(self._state.copy())
            # keep the upper band from the next hop's window on, or from the next output sample
            keep = min(max(self._at(j * hop), 0), self._out0)
            if keep > self._h0:
                self._h = self._h[keep - self._h0:]
                self._h0 = keep

    # ------------------------------------------------------------------ output
    def apply(self, y: np.ndarray) -> np.ndarray:
        """Take the enhanced low band y (m, channels) of the next stream samples; return the
        output samples whose gains are known (the low band plus the gained upper band)."""
        if len(y):
            self._y = np.concatenate([self._y, y])
        self._advance()
        limit = -(-self._next * self.hop * self.rate // self.model_rate)  # first sample of hop `_next`
        m = min(len(self._y), max(limit - self._out0, 0), self._h0 + len(self._h) - self._out0)
        return self._emit(m)

    def finish(self, y: np.ndarray, total: int) -> np.ndarray:
        """The end of the stream: the tail of the low band y, all held samples; `total` samples
        out (the low band padded with zeros or trimmed)."""
        self._drained = True
        y = np.concatenate([self._y, y])[:total]
        if len(y) < total:
            y = np.concatenate([y, np.zeros((total - len(y), self.channels), np.float32)])
        self._y = y
        self._advance()
        return self._emit(total)

    def _emit(self, m: int) -> np.ndarray:
        if m <= 0:
            return np.zeros((0, self.channels), np.float32)
        y, self._y = self._y[:m], self._y[m:]
        i = self._out0 - self._h0
        high = np.zeros((m, self.channels), np.float32)
        avail = self._h[i:i + m]
        high[:len(avail)] = avail  # past the reference's end (at most a sample or so): no upper band
        g = self._gain_per_sample(self._out0, m)
        self._out0 += m
        return (y + g * high).astype(np.float32, copy=False)

    def _gain_per_sample(self, start: int, m: int) -> np.ndarray:
        """(m, channels): hop j's gain at its last model-rate sample, linear in between."""
        s = np.arange(start, start + m, dtype=np.int64)
        num, den = s * self.model_rate, self.rate * self.hop
        j = num // den
        frac = ((num - j * den) / den)[:, None]
        table = np.concatenate([self._g_before[None], *([np.stack(self._gains)] if self._gains else [])])
        last = len(table) - 1
        hi = np.clip(j - self._g0 + 1, 0, last)  # hop j (clamped: the tail past the last step)
        lo = np.clip(j - self._g0, 0, last)  # hop j - 1
        g = np.maximum(table[lo] * (1.0 - frac) + table[hi] * frac, self.min_gain)
        nxt = ((start + m) * self.model_rate) // den  # the hop of the next sample: older gains go
        drop = min(max(nxt - self._g0, 0), len(self._gains))
        if drop:
            self._g_before = self._gains[drop - 1]
            del self._gains[:drop]
            self._g0 += drop
        return g.astype(np.float32)
