"""Full band: the band above the model's 8 kHz, cleaned for input above 16 kHz (`HighBand`).

The model runs at 16 kHz; its output, resampled back to the stream's rate, holds nothing above
8 kHz. For a stream above 16 kHz the cursor adds the upper band back, cleaned: the stream-rate
input `x`, less the low band it holds, `up(down(x))`, built from the same downsampled signal the
model steps on and upsampled by a second resampler of the same kind as the output's (so it has the
enhanced low band's alignment, sample for sample):

    high = x - up(down(x))
    out  = up(enhanced) + clean(high)

`clean` is a short-time spectral gain on `high` at the stream's rate (a `FRAME_S` hop, windows of
two hops, square-root Hann analysis and synthesis, which reconstruct exactly at unit gain), with
one gain per band of an ERB-like scale from 8 kHz to the Nyquist frequency (`BandGains`),
interpolated across bins (below 8 kHz, where `high` holds only what the resamplers' transition
bands leave of the model's band, the gain is 0, so the output taken down to 16 kHz is the model's):

* the noise of each band is tracked by a recursive average that the model's speech probability
  freezes while it hears speech, bounded below by the minimum of the band's smoothed level over
  `MIN_WINDOW_S` (so a noise that rises during a long stretch of speech is followed);
* the speech probability per 16 ms output hop is the model's: its speech `activity` (the mean gain
  over 300 Hz..4 kHz) between `ACTIVITY_OFF` and `ACTIVITY_ON`, times the enhanced low band's
  presence above its own floor; smoothed with a fast attack and a slower release;
* each band's gain, for a model with an upper-band head beside it (`upperband.npz`,
  `enhancer.upperhead`; the shipped model has one), is the head's, at least `HEAD_FLOOR` times the
  speech probability: a small GRU per band that reads the band's SNR against that noise estimate,
  its neighbours', the speech probability and the model's own gain near 8 kHz (the enhanced low
  band over the noisy input from 3 to 7.8 kHz, over the window that ends where the frame starts),
  so it follows noise that changes under the voice, which the frozen estimate cannot;
* without a head, a Wiener gain on a decision-directed a-priori SNR against that estimate, at
  least `SPEECH_FLOOR`, times the speech probability to the power `SPEECH_POWER`.

Never below the stream's gain floor (`atten_lim_db`). Everything is causal: the frame whose window
starts at sample s takes the model's speech probability at s, which is known as soon as the
enhanced low band at s is; its window reaches two hops past s, which the input holds long before
the model's delay has passed, so no sample waits longer than the low band does. The output does not
depend on how the stream was chunked. A skipped hop (the service catching up) has zero output and a
speech probability of zero.
"""
from __future__ import annotations

import itertools

import numpy as np

from .config import ModelConfig
from .errors import AudioError, StateError
from .handoff import attrs_state, load_attrs
from .resample import StreamResampler
from .upperhead import LOW_EDGES_HZ, UpperHead, features

BANDS = ("full", "speech")
DEFAULT_BAND = "full"  # above 16 kHz; at 16 kHz and below both bands give the same output

ACTIVITY_OFF = 0.20  # speech activity at or below which a hop is a pause (upper band closed)
ACTIVITY_ON = 0.45  # ... at or above which the upper band is fully open
PRESENCE_HOPS = 125  # the enhanced low band's floor: the minimum of its smoothed level over ~2 s
PRESENCE_DB = (10.0, 20.0)  # enhanced low band above that floor: closed at or below, fully open at or above
PRESENCE_FLOOR = 1e-9  # the floor is never below -90 dB (re a full-scale sine's frame energy)
LEVEL_SMOOTH = 0.7  # per model hop: weight of the past in the low band's smoothed level
ATTACK = 0.7  # per frame: share of a rise in speech probability taken at once
RELEASE = 0.25  # per frame: share of a fall taken at once

FRAME_S = 0.010  # the upper band's frame hop (windows of two hops)
LOW_HZ = 8000.0  # the upper band's lower edge
BAND_ERB = 1.25  # band width on the ERB-rate scale (8 bands from 8 to 24 kHz)
NOISE_SMOOTH = 0.9  # per frame in a pause: weight of the past in the noise estimate
MIN_WINDOW_S = 1.5  # the minimum of the smoothed level over this long bounds the noise estimate below
MIN_BIAS = 1.5  # the minimum underestimates the mean noise level by about this factor
DD = 0.9  # decision-directed a-priori SNR: weight of the last frame's clean estimate
SPEECH_FLOOR = 0.316  # a band's least gain while the model hears speech (-10 dB)
SPEECH_POWER = 0.5  # the gain scales with the speech probability to this power
HEAD_FLOOR = 0.178  # the head's least gain while the model hears speech (-15 dB), times the speech probability
_EPS = 1e-20


def check_band(band) -> str:
    """'full' or 'speech' (AudioError otherwise)."""
    if band not in BANDS:
        raise AudioError(f"band must be one of {', '.join(repr(b) for b in BANDS)}, got {band!r}")
    return band


def speech_weight(activity) -> np.ndarray:
    """The model's speech activity as a weight: 0 at or below ACTIVITY_OFF, 1 at or above
    ACTIVITY_ON, linear in between."""
    a = np.asarray(activity, np.float64)
    return np.clip((a - ACTIVITY_OFF) / (ACTIVITY_ON - ACTIVITY_OFF), 0.0, 1.0)


def uses_high_band(band: str, sample_rate: int, model_rate: int) -> bool:
    """Whether a stream of `band` at `sample_rate` keeps an upper band."""
    return band == "full" and sample_rate > model_rate


def _erb_rate(f):
    return 21.4 * np.log10(1.0 + 0.00437 * np.asarray(f, np.float64))


def _erb_hz(e):
    return (10.0 ** (np.asarray(e, np.float64) / 21.4) - 1.0) / 0.00437


def band_edges(sample_rate: int) -> np.ndarray:
    """The upper band's band edges in Hz, from LOW_HZ to the Nyquist frequency, about BAND_ERB
    wide on the ERB-rate scale (at least one band)."""
    lo, hi = _erb_rate(LOW_HZ), _erb_rate(sample_rate / 2)
    k = max(1, int(round((hi - lo) / BAND_ERB)))
    return _erb_hz(np.linspace(lo, hi, k + 1))


class BandGains:
    """Per-band noise tracking and gains of one stream's upper band, frame by frame.

    `step(power, speech, low)`: the frame's power spectrum (channels, bins), the model's speech
    probability (channels,) and, for the learned head, the low band's power spectra (the enhanced
    and the noisy input's over the last window, the noisy input's over this frame's; each
    (channels, bins)) -> the gain per bin (channels, bins): the head's, or without one the
    per-band Wiener gain."""

    def __init__(self, sample_rate: int, n_fft: int, hop: int, channels: int, head: UpperHead | None = None):
        f = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
        edges = band_edges(sample_rate)
        self.k = len(edges) - 1
        self.head = head
        self.centers_hz = 0.5 * (edges[:-1] + edges[1:])
        low = np.stack([(f >= a) & (f < b) for a, b in itertools.pairwise(LOW_EDGES_HZ)]).astype(np.float64)
        self._low = (low / np.maximum(low.sum(1, keepdims=True), 1.0)).T  # bins -> the low-band cues' bands
        self._h = head.state((channels, self.k)) if head is not None else None
        idx = np.clip(np.searchsorted(edges, f, side="right") - 1, 0, self.k - 1)
        self._member = np.zeros((self.k, len(f)), np.float64)  # band averaging (bins below 8 kHz: none)
        inside = f >= edges[0]
        self._member[idx[inside], np.flatnonzero(inside)] = 1.0
        self._member /= np.maximum(self._member.sum(1, keepdims=True), 1.0)
        centers = _erb_rate(self.centers_hz)
        self._interp = np.zeros((len(f), self.k), np.float64)  # band gains -> bin gains, linear in ERB rate
        e = _erb_rate(f)
        for i, x in enumerate(e):
            if f[i] < LOW_HZ:  # the model's band: what the resamplers leave of it there is not added again
                continue
            if self.k == 1 or x <= centers[0]:
                self._interp[i, 0] = 1.0
            elif x >= centers[-1]:
                self._interp[i, -1] = 1.0
            else:
                j = int(np.searchsorted(centers, x)) - 1
                w = (x - centers[j]) / (centers[j + 1] - centers[j])
                self._interp[i, j], self._interp[i, j + 1] = 1.0 - w, w
        self.min_frames = max(1, int(round(MIN_WINDOW_S * sample_rate / hop)))
        c = channels
        self.frames = 0
        self.noise = np.zeros((c, self.k))
        self.smooth = np.zeros((c, self.k))
        self.history = _RunningMin(self.min_frames)  # the smoothed level of the last `min_frames` frames
        self.clean = np.zeros((c, self.k))  # the last frame's clean power estimate (G^2 P)

    def step(self, power: np.ndarray, speech: np.ndarray, low=None) -> np.ndarray:
        p = power @ self._member.T  # (c, k) mean power per band
        s = speech[:, None]
        if self.frames == 0:
            self.noise, self.smooth = p.copy(), p.copy()
        else:
            a = NOISE_SMOOTH + (1.0 - NOISE_SMOOTH) * s  # frozen while the model hears speech
            self.noise = a * self.noise + (1.0 - a) * p
            self.smooth = 0.7 * self.smooth + 0.3 * p
        self.frames += 1
        floor = MIN_BIAS * self.history.push(self.smooth)
        self.noise = np.maximum(np.minimum(self.noise, self.smooth * 4.0), np.minimum(floor, self.smooth))
        if self.head is not None:
            x = features(p, self.noise, speech, *(q @ self._low for q in low), self.centers_hz)
            learned, self._h = self.head.step(x, self._h)
            return np.maximum(learned, HEAD_FLOOR * s) @ self._interp.T
        n = np.maximum(self.noise, _EPS)
        post = p / n
        prior = DD * self.clean / n + (1.0 - DD) * np.maximum(post - 1.0, 0.0)
        g = np.maximum(prior / (1.0 + prior), SPEECH_FLOOR) * s ** SPEECH_POWER
        self.clean = g * g * p
        return g @ self._interp.T

    _STATE = ("frames", "noise", "smooth", "history", "clean", "_h")

    def state(self) -> dict:
        return attrs_state(self, self._STATE)

    def load_state(self, state: dict) -> None:
        load_attrs(self, self._STATE, state)


class _RunningMin:
    """The minimum of the last `n` values pushed (arrays of one shape)."""

    def __init__(self, n: int):
        self.n, self.count, self._ring = n, 0, None

    def push(self, value: np.ndarray) -> np.ndarray:
        if self._ring is None:
            self._ring = np.zeros((self.n,) + np.shape(value), np.float64)
        self._ring[self.count % self.n] = value
        self.count += 1
        return self._ring[:min(self.count, self.n)].min(axis=0)

    def state(self) -> dict:
        return attrs_state(self, ("count", "_ring"))

    def load_state(self, state: dict) -> None:
        if state["ring"] is not None and state["ring"].shape[0] != self.n:
            raise StateError(f"a running minimum of {self.n} values holds {state['ring'].shape[0]}")
        load_attrs(self, ("count", "_ring"), state)


def _window_at(buf: np.ndarray, first: int, start: int, n: int) -> np.ndarray:
    """Samples [start, start + n) of a buffer that holds the signal from sample `first` on (zeros
    where it holds nothing), (n, channels) float64."""
    seg = np.zeros((n, buf.shape[1]), np.float64)
    a, b = max(start, first), min(start + n, first + len(buf))
    if b > a:
        seg[a - start:b - start] = buf[a - first:b - first]
    return seg


def _drop(buf: np.ndarray, first: int, keep: int) -> tuple[np.ndarray, int]:
    """The buffer without its samples before `keep`."""
    if keep > first:
        return buf[keep - first:], keep
    return buf, first


def _sqrt_hann(n: int) -> np.ndarray:
    return np.sqrt(0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n))


class HighBand:
    """One stream's upper band: its buffers, the reference resampler, and its cleaning.

    The cursor hands it the stream's input (`push`), the hops going to the model (`take`), the
    model's results (`put`) and the enhanced low band at the stream's rate (`apply`, `finish`),
    which it returns with the cleaned upper band added, as far as that is known."""

    def __init__(self, config: ModelConfig, sample_rate: int, channels: int, min_gain: float = 0.0,
                 head: UpperHead | None = None):
        st = config.stft
        self.rate, self.model_rate, self.hop, self.channels = sample_rate, st.sample_rate, st.hop, channels
        if config.delay_samples % st.hop:
            raise ValueError("the model's delay must be a whole number of hops")
        self.lookahead_hops = config.delay_samples // st.hop  # output hop j comes out of step j + this
        self.min_gain = float(min_gain)
        c = channels
        # the frame hop: FRAME_S, or less where the model's delay is shorter than two of them
        delay = config.delay_samples * sample_rate // st.sample_rate
        self.fhop = max(16, min(int(FRAME_S * sample_rate), (delay - int(0.004 * sample_rate)) // 2))
        self._window = _sqrt_hann(2 * self.fhop)
        self._gains = BandGains(sample_rate, 2 * self.fhop, self.fhop, c, head)
        self._head = head is not None
        self._xs = np.zeros((0, c), np.float32)  # (head) the input from sample `_xs0` on
        self._xs0 = 0
        self._lows = np.zeros((0, c), np.float32)  # (head) the enhanced low band from sample `_lows0` on
        self._lows0 = 0
        self._rs_ref = StreamResampler(self.model_rate, sample_rate, c)
        self._x = np.zeros((0, c), np.float32)  # stream-rate input not yet in `_h`
        self._r = np.zeros((0, c), np.float32)  # up(down(x)) not yet in `_h`
        self._h = np.zeros((0, c), np.float32)  # the upper band x - up(down(x)) from sample `_h0` on
        self._h0 = 0
        self._drained = False  # the reference resampler has been drained: `_h` is complete
        self._ended = False  # finish() has been called: no model result follows
        self._y = np.zeros((0, c), np.float32)  # enhanced low band from sample `_out0` on, held
        self._out0 = 0  # the next output sample
        self._syn = np.zeros((0, c), np.float64)  # the cleaned upper band from `_out0` on (overlap-add)
        self._frame = 0  # the next frame: its window covers [(f - 1) fhop, (f + 1) fhop)
        self._speech: list[np.ndarray] = []  # per output hop from `_s0` on: speech probability (c,)
        self._s0 = 0
        self._known = 0  # output hops whose speech probability is known
        self._p = np.zeros(c, np.float64)  # the smoothed speech probability
        self._steps = 0  # model steps put so far
        self._lb_level = np.zeros(c, np.float64)  # smoothed enhanced low-band level
        self._lb_levels = _RunningMin(PRESENCE_HOPS)  # its last PRESENCE_HOPS values

    _STATE = ("_gains", "_xs", "_xs0", "_lows", "_lows0", "_rs_ref", "_x", "_r", "_h", "_h0", "_drained", "_ended",
              "_y", "_out0", "_syn", "_frame", "_s0", "_known", "_p", "_steps", "_lb_level", "_lb_levels")

    def state(self) -> dict:
        """What `load_state` continues from in another process (`enhancer.handoff`)."""
        out = attrs_state(self, self._STATE)
        out["speech"] = np.array(self._speech, np.float64).reshape(-1, self.channels)
        return out

    def load_state(self, state: dict) -> None:
        load_attrs(self, self._STATE, state)
        self._speech = list(np.asarray(state["speech"], np.float64).reshape(-1, self.channels))

    @property
    def held(self) -> int:
        """Enhanced low-band samples held until their upper band is known."""
        return len(self._y)

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
            if self._head:
                self._xs = np.concatenate([self._xs, self._x[:k]])
            self._h = np.concatenate([self._h, self._x[:k] - self._r[:k]])
            self._x, self._r = self._x[k:], self._r[k:]
        if last:  # the input past the reference's end has no upper band
            self._drained = True

    # ------------------------------------------------------------------ the model's result
    def put(self, out: np.ndarray, activity: np.ndarray | None) -> None:
        """The model's output hops (channels, n, hop) of the next n steps and their activity
        (channels, n) (None: not known, taken as speech)."""
        n, la, hop = out.shape[1], self.lookahead_hops, self.hop
        first = self._steps
        self._steps += n
        ts = [t for t in range(n) if first + t >= la]  # steps whose output hop is audio, not delay
        if not ts:
            return
        enhanced_level = (out[:, ts].astype(np.float64) ** 2).mean(-1) * (2 * hop)  # (c, len(ts))
        if activity is None:
            speech = np.ones(enhanced_level.shape)
        else:
            speech = speech_weight(np.asarray(activity)[:, ts])
        for i in range(len(ts)):  # the enhanced low band against its own floor: is there speech at all?
            lv = enhanced_level[:, i]
            self._lb_level = lv if first + ts[i] == la else LEVEL_SMOOTH * self._lb_level + (1 - LEVEL_SMOOTH) * lv
            floor = np.maximum(self._lb_levels.push(self._lb_level), PRESENCE_FLOOR * (2 * hop) / 4)
            db = 10.0 * np.log10(np.maximum(self._lb_level, 1e-30) / floor)
            presence = np.clip((db - PRESENCE_DB[0]) / (PRESENCE_DB[1] - PRESENCE_DB[0]), 0.0, 1.0)
            self._speech.append(speech[:, i] * presence)
            self._known += 1

    def _speech_at(self, sample: int) -> np.ndarray | None:
        """The model's speech probability at stream sample `sample` (zero before the first output
        hop, and past the last once the stream has ended); None while it is not known yet."""
        if sample < 0:
            return np.zeros(self.channels)
        j = sample * self.model_rate // (self.rate * self.hop)
        if j >= self._known:
            return np.zeros(self.channels) if self._ended else None
        return self._speech[j - self._s0]

    # ------------------------------------------------------------------ cleaning
    def _advance(self) -> None:
        """Clean every frame whose window and speech probability are both there (at the end of the
        stream: every frame the held output needs)."""
        H = self.fhop
        while True:
            f = self._frame
            start, end = (f - 1) * H, (f + 1) * H
            if self._ended and self._final() >= self._out0 + len(self._y):
                return
            if end > self._h0 + len(self._h) and not self._drained:
                return
            speech = self._speech_at(start)
            if speech is None:
                return
            low = None
            if self._head:
                if start > self._lows0 + len(self._lows) and not self._ended:
                    return
                low = self._low_spectra(start)
            seg = _window_at(self._h, self._h0, start, 2 * H)
            rate = np.where(speech > self._p, ATTACK, RELEASE)
            self._p = self._p + rate * (speech - self._p)
            spec = np.fft.rfft(seg.T * self._window, axis=-1)  # (c, bins)
            g = np.maximum(self._gains.step(np.abs(spec) ** 2, self._p, low), self.min_gain)
            y = np.fft.irfft(spec * g, 2 * H, axis=-1).T * self._window[:, None]  # (2H, c)
            lo = max(start, self._out0)  # overlap-add into the output from `_out0` on
            if end > lo:
                need = end - self._out0
                if len(self._syn) < need:  # grown geometrically: zeros past `end` are where later frames add
                    grow = max(need, 2 * len(self._syn)) - len(self._syn)
                    self._syn = np.concatenate([self._syn, np.zeros((grow, self.channels))])
                self._syn[lo - self._out0:end - self._out0] += y[lo - start:]
            self._frame += 1
            keep = f * H  # the next window starts here
            if self._head:  # the head's windows start two frames earlier
                self._xs, self._xs0 = _drop(self._xs, self._xs0, keep - 2 * H)
                self._lows, self._lows0 = _drop(self._lows, self._lows0, keep - 2 * H)
            self._h, self._h0 = _drop(self._h, self._h0, keep)
            drop = max(keep, 0) * self.model_rate // (self.rate * self.hop) - self._s0  # hops no window needs
            if drop > 0:
                del self._speech[:drop]
                self._s0 += drop

    def _low_spectra(self, start: int) -> np.ndarray:
        """(head) The power spectra (3, channels, bins) of the enhanced and the noisy input over the
        window that ends at `start`, and of the noisy input over the one that starts there (zeros
        outside the stream), in one transform."""
        n = 2 * self.fhop
        segs = np.stack([_window_at(self._lows, self._lows0, start - n, n), _window_at(self._xs, self._xs0, start - n, n),
                         _window_at(self._xs, self._xs0, start, n)], 1)  # (n, 3, c)
        return (np.abs(np.fft.rfft(segs.T * self._window, axis=-1)) ** 2).transpose(1, 0, 2)

    def _final(self) -> int:
        """Output samples whose upper band is complete: those of frames before the last one done."""
        return max((self._frame - 1) * self.fhop, 0)

    # ------------------------------------------------------------------ output
    def apply(self, y: np.ndarray) -> np.ndarray:
        """Take the enhanced low band y (m, channels) of the next stream samples; return the
        output samples whose upper band is known (the low band plus the cleaned upper band)."""
        if len(y):
            self._y = np.concatenate([self._y, y])
            if self._head:
                self._lows = np.concatenate([self._lows, y])
        self._advance()
        return self._emit(min(len(self._y), self._final() - self._out0))

    def finish(self, y: np.ndarray, total: int) -> np.ndarray:
        """The end of the stream: the tail of the low band y, all held samples; `total` samples
        out (the low band padded with zeros or trimmed)."""
        self._drained = self._ended = True
        y = np.concatenate([self._y, y])[:total]
        if len(y) < total:
            y = np.concatenate([y, np.zeros((total - len(y), self.channels), np.float32)])
        if self._head:
            self._lows = np.concatenate([self._lows, y[len(self._y):]])
        self._y = y
        self._advance()
        return self._emit(total)

    def _emit(self, m: int) -> np.ndarray:
        if m <= 0:
            return np.zeros((0, self.channels), np.float32)
        y, self._y = self._y[:m], self._y[m:]
        high = np.zeros((m, self.channels), np.float64)
        k = min(m, len(self._syn))
        high[:k] = self._syn[:k]
        self._syn = self._syn[k:]
        self._out0 += m
        return (y + high).astype(np.float32)
