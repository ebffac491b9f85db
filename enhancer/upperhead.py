"""The upper band's learned gains (`UpperHead`): a small recurrent head per band, in numpy.

For every frame of the upper band (`enhancer.fullband`) and every band of it, the head reads what
is known at that frame:

* the band's noisy power against the noise tracker's estimate (its a-posteriori SNR), its level,
  and its neighbours' SNR; where the band lies; the model's speech probability;
* the model's gain near 8 kHz: the enhanced low band's power over the noisy input's in five bands
  from 3 to 7.8 kHz, over the window that ends where the frame starts (the newest the enhanced
  low band holds without delaying the output);
* the enhanced low band's and the noisy input's power in those bands against the band's own.

A linear layer, a GRU and a sigmoid give the band's gain; its state carries each band's history.
One set of weights serves every band and every rate (the bands differ by their place). Weights
(`upperband.npz` beside a model; the shipped model has one) come from `training.upperband`, with
the model frozen, on full-band mixtures of the corpus's training rows.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import CheckpointError

LOW_EDGES_HZ = (3000.0, 4000.0, 5000.0, 6000.0, 7000.0, 7800.0)  # the low-band cues' bands
N_FEATURES = 6 + 3 * (len(LOW_EDGES_HZ) - 1)  # inputs per band: six of the band, three per low-band cue
WEIGHTS = "upperband.npz"
_KEYS = ("inp_w", "inp_b", "w_ih", "w_hh", "b_ih", "b_hh", "out_w", "out_b")


def _db(x):
    return 10.0 * np.log10(np.maximum(x, 1e-12))


def features(power, noise, speech, low_out, low_in, low_now, centers_hz) -> np.ndarray:
    """The head's input (c, K, N_FEATURES): `power`, `noise` (c, K) the bands' noisy power and noise
    estimate; `speech` (c,) the speech probability; `low_out`, `low_in` (c, 5) the enhanced and the
    noisy low band's power over the last window, `low_now` (c, 5) the noisy low band's over this
    frame's; `centers_hz` (K,) the bands' centres."""
    c, k = power.shape
    b = len(LOW_EDGES_HZ) - 1
    p, lo, ln = _db(power), _db(low_out), _db(low_now)
    post = _clip(p - _db(noise), -10.0, 40.0) / 10.0
    x = np.empty((c, k, N_FEATURES), np.float32)
    x[..., 0] = post
    x[..., 1] = (p + 60.0) / 30.0
    x[:, 0, 2], x[:, 1:, 2] = post[:, 0], post[:, :-1]  # the band below (the lowest: itself)
    x[:, -1, 3], x[:, :-1, 3] = post[:, -1], post[:, 1:]  # the band above (the highest: itself)
    x[..., 4] = (np.asarray(centers_hz) - 8000.0) / 16000.0
    x[..., 5] = np.asarray(speech, np.float64)[:, None]
    x[..., 6:6 + b] = (_clip(lo - _db(low_in), -40.0, 5.0) / 10.0)[:, None, :]
    x[..., 6 + b:6 + 2 * b] = _clip(lo[:, None, :] - p[:, :, None], -40.0, 60.0) / 20.0
    x[..., 6 + 2 * b:] = _clip(ln[:, None, :] - p[:, :, None], -40.0, 60.0) / 20.0
    return x


def _clip(x, lo, hi):
    return np.minimum(np.maximum(x, lo), hi)


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


class UpperHead:
    """The head's weights; `state(shape)` and `step(x, h)` run it frame by frame."""

    def __init__(self, arrays: dict):
        missing = [k for k in _KEYS if k not in arrays]
        if missing:
            raise CheckpointError(f"upper-band head weights lack {', '.join(missing)}")
        a = {k: np.asarray(arrays[k], np.float32) for k in _KEYS}
        self.hidden = a["w_hh"].shape[1]
        if a["w_ih"].shape != (3 * self.hidden, a["inp_w"].shape[0]) or a["w_hh"].shape != (3 * self.hidden, self.hidden):
            raise CheckpointError("upper-band head weights have inconsistent shapes")
        if a["inp_w"].shape[1] != N_FEATURES:
            raise CheckpointError(f"the upper-band head reads {a['inp_w'].shape[1]} inputs per band; this runtime "
                                  f"gives {N_FEATURES} (train it again: python -m training.upperband)")
        self.inp_w, self.inp_b = a["inp_w"].T.copy(), a["inp_b"]
        self.w_ih, self.w_hh, self.b_ih, self.b_hh = a["w_ih"].T.copy(), a["w_hh"].T.copy(), a["b_ih"], a["b_hh"]
        self.out_w, self.out_b = a["out_w"].reshape(-1), float(a["out_b"].reshape(-1)[0])

    @classmethod
    def load(cls, path: Path) -> UpperHead:
        try:
            with np.load(path, allow_pickle=False) as z:
                return cls({k: z[k] for k in z.files})
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read the upper-band head {path}: {e}") from e

    def state(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape + (self.hidden,), np.float32)

    def step(self, x: np.ndarray, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x (..., features), h (..., hidden) -> (gain (...), next h)."""
        u = np.maximum(x @ self.inp_w + self.inp_b, 0.0)
        gi = u @ self.w_ih + self.b_ih
        gh = h @ self.w_hh + self.b_hh
        n = self.hidden
        r = _sigmoid(gi[..., :n] + gh[..., :n])
        z = _sigmoid(gi[..., n:2 * n] + gh[..., n:2 * n])
        cand = np.tanh(gi[..., 2 * n:] + r * gh[..., 2 * n:])
        h = ((1.0 - z) * cand + z * h).astype(np.float32)
        return _sigmoid(h @ self.out_w + self.out_b), h
