"""The rise limit: a post-filter on the network's gains against bursts of residual noise.

Where the noise is much louder than the speech, a low gain that jumps above the previous frame's
for a single frame lets a short burst of noise through; listeners hear these as the residual noise
under speech. The rise limit keeps a gain below `rise_limit_gain` from rising above the previous
frame's network gain in the same bin, and applies in proportion to how noisy the stream is:

    limited = min(g_t, g_{t-1})  where g_t < rise_limit_gain, else g_t
    gain    = g_t - w * (g_t - limited)
    w       = clip((hi - snr) / (hi - lo), 0, 1)       (lo, hi) = rise_limit_snr_db

`snr` is a running estimate (time constant `rise_limit_seconds`) of the energy the network keeps
against the energy it removes: 10 log10(E[sum g^2 |X|^2] / E[sum (1 - g^2) |X|^2]) over the frames
so far. It reads lower than the mixture's speech-to-noise ratio (pauses count as removed energy):
about -7 dB on 0 dB mixtures, 1 dB on 10 dB mixtures, 4.5 dB on 20 dB mixtures, so the default
(-6, 3) applies the limit in full at 0 dB and below and not at all from about 20 dB up. Gains of
speech onsets that rise above `rise_limit_gain` pass unchanged.

Causal: frame t reads frames <= t only, so the model's latency is unchanged. The step graph carries
the previous frame's gains and the two running energies per stream (state caches `prev_gain` and
`energy`); the offline reference starts from the same zero state, so any chunking gives the same
output.
"""
from __future__ import annotations

import math

import torch

from ...config import ModelConfig

EPS = 1e-9  # energy floor of the running estimate (digital silence reads 0 dB)


def decay(cfg: ModelConfig) -> float:
    """Per-frame decay of the running energies."""
    return math.exp(-cfg.stft.hop / cfg.stft.sample_rate / cfg.rise_limit_seconds)


def rise_limit(cfg: ModelConfig, gains: torch.Tensor, power: torch.Tensor, prev_gain: torch.Tensor,
               energy: torch.Tensor, first: torch.Tensor | None = None,
               frames: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gains (B, T, F): the network's gains; power (B, T, F): |X|^2 of the frames they apply to;
    prev_gain (B, F): the network's gains of the frame before the first (0 for a fresh stream);
    energy (B, 2): the running [kept, removed] energies before the first frame (0 when fresh);
    first (B,) int: the stream's index of the first frame, where the call may start before the
    stream does (the step graph's first `lookahead` gains apply to silence before it): the frame 0
    of a stream is compared with 0, as in the offline reference, not with such a gain; `frames`: T
    when it is fixed (a graph traced at one T: its shapes are then constants).

    Returns the limited gains (B, T, F) and the new (prev_gain, energy)."""
    t = frames or gains.shape[1]
    a = decay(cfg)
    kept = (gains * gains * power).sum(-1)  # (B, T)
    removed = torch.clamp(power.sum(-1) - kept, min=0.0)
    i = torch.arange(t, device=gains.device)
    lag = (i[:, None] - i[None, :]).to(gains.dtype)  # (T, T): t - t'
    weights = torch.where(lag >= 0, (1.0 - a) * torch.exp(lag.clamp(min=0.0) * math.log(a)), torch.zeros_like(lag))
    carry = torch.exp((i.to(gains.dtype) + 1.0) * math.log(a))  # (T,): what is left of the state at frame t
    e_kept = kept @ weights.transpose(0, 1) + energy[:, :1] * carry  # (B, T)
    e_removed = removed @ weights.transpose(0, 1) + energy[:, 1:] * carry
    snr = 10.0 * torch.log10((e_kept + EPS) / (e_removed + EPS))
    lo, hi = cfg.rise_limit_snr_db
    w = torch.clamp((hi - snr) / (hi - lo), 0.0, 1.0)[..., None]  # (B, T, 1)
    before = torch.cat([prev_gain[:, None], gains[:, :-1]], dim=1)  # (B, T, F)
    if first is not None:
        before = before * ((first[:, None] + i[None, :]) >= 1).to(gains.dtype)[..., None]
    limited = torch.where(gains < cfg.rise_limit_gain, torch.minimum(gains, before), gains)
    out = gains - w * (gains - limited)
    return out, gains[:, -1], torch.stack([e_kept[:, -1], e_removed[:, -1]], dim=-1)
