"""Output level: `level="input"` gives the voice back at the input's speech level (`LevelGain`).

The model removes noise and returns the voice a few dB quieter than it came in (3 dB on the median
file of the unseen-source dev set). With `level="model"` (the default) the output is the model's as
it is; with `level="input"` a stream's output is multiplied by one running gain, the same for all
its channels, that restores the level of the speech in its input:

* per 16 ms output hop `j` (at the model's 16 kHz): the input's energy `e_in` (mean square over
  the hop, mean over the channels) of the same samples as that output hop, the output's energy
  `e_out` and the model's speech activity (the step graph's `activity`, the mean gain over
  300 Hz..4 kHz, mean over the channels), turned into a speech weight `w` in [0, 1] by the same
  ramp as the upper band's (`enhancer.fullband.ACTIVITY_OFF` .. `ACTIVITY_ON`);
* speech-weighted running sums with forgetting over speech time only (time constant `SPEECH_S`,
  so pauses neither count nor make it forget): `S_in = sum w e_in`, `S_out = sum w e_out`,
  `W = sum w`;
* the gain, in dB: `10 log10(S_in / S_out)`, the input's level over the output's in the hops the
  model marks as speech, bounded to 0..`MAX_GAIN_DB`; until `W` holds `WARMUP_S` of speech it is
  scaled by `W / (WARMUP_S of hops)`, so a stream starts at the model's level and moves to the
  input's as speech comes in;
* hop `j`'s gain is reached at its last sample, linearly interpolated per sample in between, at
  the stream's rate (after the resampler and the upper band, `enhancer.fullband`).

The input's level in speech holds its noise too (at 10 dB SNR 0.4 dB over the voice's own level,
at 0 dB 3 dB), so in loud noise the voice comes back up to that much louder than it was spoken.

Everything is causal and per hop, from values the model computes for every chunking alike, so a
stream gives the output of offline enhancement (within the model's own chunking differences), and
the gain moves only as fast as the running sums: slowly, with no pumping between words. A hop
skipped to catch up (the service) has no output and no activity: it leaves the gain as it is.
"""
from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig
from .errors import AudioError
from .fullband import speech_weight
from .handoff import attrs_state, load_attrs

LEVELS = ("model", "input")
DEFAULT_LEVEL = "model"  # the model's output as it is (bit-identical to no level option at all)

SPEECH_S = 4.0  # memory of the speech-weighted sums, in seconds of speech
WARMUP_S = 0.5  # speech heard before the gain applies in full
MAX_GAIN_DB = 12.0  # the gain stays within 0 dB (the model's level) .. this
_TINY = 1e-12  # energy floor (a silent stream keeps the model's level)


def check_level(level) -> str:
    """'model' or 'input' (AudioError otherwise)."""
    if level not in LEVELS:
        raise AudioError(f"level must be one of {', '.join(repr(v) for v in LEVELS)}, got {level!r}")
    return level


class LevelGain:
    """One stream's running output gain (`level="input"`, see the module docstring).

    The cursor hands it the model-rate input hops as they go to the model (`take`), each call's
    output hops and activity (`put`), and the output at the stream's rate (`apply`)."""

    def __init__(self, config: ModelConfig, sample_rate: int):
        st = config.stft
        if config.delay_samples % st.hop:
            raise ValueError("the model's delay must be a whole number of hops")
        self.rate, self.model_rate, self.hop = sample_rate, st.sample_rate, st.hop
        self.lookahead_hops = config.delay_samples // st.hop  # output hop j comes out of step j + this
        hop_s = st.hop / st.sample_rate
        self._keep_speech = math.exp(-hop_s / SPEECH_S)
        self._warmup = WARMUP_S / hop_s  # hops of full speech
        self._e_in: list[float] = []  # input energy of hop `_in0` on (taken, not yet put back)
        self._in0 = 0
        self._steps = 0  # steps put so far
        self._s_in = self._s_out = self._w = 0.0
        self._gains: list[float] = []  # per output hop, hop `_g0` first
        self._g0 = 0
        self._g_before = 1.0  # the gain of hop `_g0 - 1`

    _STATE = ("_in0", "_steps", "_s_in", "_s_out", "_w", "_g0", "_g_before")

    def state(self) -> dict:
        """What `load_state` continues from in another process (`enhancer.handoff`)."""
        out = attrs_state(self, self._STATE)
        out["e_in"], out["gains"] = np.array(self._e_in, np.float64), np.array(self._gains, np.float64)
        return out

    def load_state(self, state: dict) -> None:
        load_attrs(self, self._STATE, state)
        self._e_in, self._gains = [float(v) for v in state["e_in"]], [float(v) for v in state["gains"]]

    # ------------------------------------------------------------------ the model's side
    def take(self, hops: np.ndarray) -> None:
        """Model-rate input hops (channels, n, hop) as they go to the model (or are skipped)."""
        e = np.mean(np.square(hops, dtype=np.float64), axis=(0, 2))
        self._e_in.extend(float(v) for v in e)

    def put(self, out: np.ndarray, activity: np.ndarray | None) -> None:
        """The model's output hops (channels, n, hop) of the next n steps and their activity
        (channels, n) (None: not known, taken as speech)."""
        n = out.shape[1]
        e_out = np.mean(np.square(out, dtype=np.float64), axis=(0, 2))
        if activity is None:
            speech = np.ones(n)
        else:
            speech = speech_weight(np.mean(np.asarray(activity, np.float64), axis=0))
        for t in range(n):
            j = self._steps - self.lookahead_hops  # the output hop of this step
            self._steps += 1
            if j < 0:  # the model's delay: no output hop yet
                continue
            e_in = self._e_in[j - self._in0]
            self._update(e_in, float(e_out[t]), float(speech[t]))
            self._gains.append(self._gain())
        k = self._steps - self.lookahead_hops - self._in0  # input hops whose output hop is done
        if k > 0:
            del self._e_in[:k]
            self._in0 += k

    def _update(self, e_in: float, e_out: float, w: float) -> None:
        if w > 0.0:  # speech (or partly): the sums forget as fast as they take in
            keep = self._keep_speech ** w
            self._s_in = keep * self._s_in + w * e_in
            self._s_out = keep * self._s_out + w * e_out
            self._w = keep * self._w + w

    def _gain(self) -> float:
        if self._w <= 0.0 or self._s_out <= _TINY * self._w:
            return 1.0
        db = 10.0 * math.log10(max(self._s_in, _TINY * self._w) / self._s_out)
        db = min(max(db, 0.0), MAX_GAIN_DB) * min(self._w / self._warmup, 1.0)
        return 10.0 ** (db / 20.0)

    # ------------------------------------------------------------------ output
    def apply(self, y: np.ndarray, start: int) -> np.ndarray:
        """y (m, channels) at the stream's rate from output sample `start` on, times the gain."""
        m = y.shape[0]
        if not m:
            return y
        s = np.arange(start, start + m, dtype=np.int64)
        num, den = s * self.model_rate, self.rate * self.hop
        j = num // den  # the output hop of each sample
        frac = (num - j * den) / den
        table = np.array([self._g_before, *self._gains], np.float64)
        last = len(table) - 1
        hi = np.clip(j - self._g0 + 1, 0, last)  # hop j (clamped: past the last step, its gain)
        lo = np.clip(j - self._g0, 0, last)  # hop j - 1
        g = table[lo] * (1.0 - frac) + table[hi] * frac
        nxt = ((start + m) * self.model_rate) // den  # the hop of the next sample: older gains go
        drop = min(max(nxt - self._g0, 0), len(self._gains))
        if drop:
            self._g_before = self._gains[drop - 1]
            del self._gains[:drop]
            self._g0 += drop
        return (y * g[:, None]).astype(np.float32, copy=False)
