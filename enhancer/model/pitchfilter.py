"""The pitch filter: a comb filter at the voice's pitch that removes noise between its harmonics.

A gain per bin cannot separate a voice's harmonics from the noise that shares their bins: at 31 Hz
per bin, noise between the harmonics is kept with them, and listeners hear it as roughness and
residual noise on voiced speech. As in RNNoise (Valin, 2018, section 4), each frame's noisy
spectrum X is mixed with P, the spectrum of the noisy input one pitch period earlier (same window):
the voice's harmonics add in phase, the noise does not.

    X' = X + r * P,    then rescaled per band to X's energy, then the gains apply as before

In each band b the mixing weight is set from the pitch correlation of the band, c_b = Re<X, P> /
(|X| |P|), and the band's gain g_b (the energy the gains keep): where the gain keeps less of the
band than the correlation says is periodic, the band is noise-dominated and more of P is added:

    r_b = strength * sqrt(clip(c_b^2 (1 - g_b^2) / (1e-3 + g_b^2 (1 - c_b^2)), 0, 1)) * sqrt(E_X / E_P)
    (r_b = strength * sqrt(E_X / E_P) where c_b > g_b; r_b = 0 where c_b <= 0)

interpolated linearly between band centres. The filter applies only in voiced frames: those whose
pitch estimate has a normalised correlation above `pitch_filter_voicing`.

The pitch is estimated by YIN (de Cheveigne & Kawahara, 2002) on the frame's enhanced spectrum
without the filter, |g X|^2: its inverse DFT is the frame's (circular) autocorrelation, divided by
the window's own so that lags are not penalised for the window's taper; from it, YIN's normalised
difference at lags of 32 to 320 samples (50 to 500 Hz). The estimate reads the frame the gains
apply to and P reads past input only, so the model's latency is unchanged; the step graph carries
the noisy input of the last `HISTORY` samples (state cache `pitch_x`).
"""
from __future__ import annotations

import numpy as np
import torch

from ..config import ModelConfig

LAG_MIN, LAG_MAX = 32, 320  # pitch lags searched, in samples at 16 kHz: 500 Hz down to 50 Hz
YIN_THRESHOLD = 0.2  # the first lag whose normalised difference falls below this is the period
BAND_EDGES_HZ = (0, 200, 400, 600, 800, 1000, 1200, 1400, 1600, 2000, 2400, 2800, 3200, 4000, 4800, 5600, 6800, 8000)


def bands(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """(F, NB) band membership (sums bins into bands) and (NB, F) linear interpolation of band
    values to bins, between band centres."""
    f = cfg.n_freqs
    nyq = cfg.stft.sample_rate / 2
    edges = [int(round(e / nyq * (f - 1))) for e in BAND_EDGES_HZ]
    nb = len(edges) - 1
    member = np.zeros((f, nb))
    for b in range(nb):
        member[edges[b]:edges[b + 1] + (1 if b == nb - 1 else 0), b] = 1.0
    centre = np.array([(edges[b] + edges[b + 1]) / 2 for b in range(nb)])
    interp = np.zeros((nb, f))
    for k in range(f):
        if k <= centre[0]:
            interp[0, k] = 1.0
        elif k >= centre[-1]:
            interp[-1, k] = 1.0
        else:
            j = int(np.searchsorted(centre, k)) - 1
            a = (k - centre[j]) / (centre[j + 1] - centre[j])
            interp[j, k], interp[j + 1, k] = 1.0 - a, a
    return member.astype(np.float32), interp.astype(np.float32)


def acf_basis(cfg: ModelConfig, window: np.ndarray) -> np.ndarray:
    """(F, LAG_MAX + 1): a power spectrum (..., F) @ this = the frame's circular autocorrelation at
    lags 0..LAG_MAX (the inverse real DFT, cosine terms), each lag divided by the window's own
    autocorrelation at that lag relative to lag 0."""
    n, f = cfg.stft.n_fft, cfg.n_freqs
    a = np.full(f, 2.0)
    a[0] = a[-1] = 1.0
    lags = np.arange(LAG_MAX + 1)
    basis = a[:, None] * np.cos(2.0 * np.pi * np.arange(f)[:, None] * lags[None, :] / n) / n
    w = np.abs(np.fft.rfft(window.astype(np.float64), n=n)) ** 2
    own = w @ basis  # the window's autocorrelation
    return (basis / (own / own[0])[None, :]).astype(np.float32)


def yin(power: torch.Tensor, acf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """power (B, T, F): |g X|^2 of the frames; acf: `acf_basis`. Returns the pitch lag (B, T) int64
    in [LAG_MIN, LAG_MAX] and the normalised autocorrelation at that lag (B, T) (the voicing)."""
    r = power @ acf  # (B, T, LAG_MAX + 1)
    r0 = r[..., :1]
    diff = torch.clamp(2.0 * (r0 - r[..., 1:]), min=0.0)  # lags 1..LAG_MAX
    lags = torch.arange(1, LAG_MAX + 1, device=power.device, dtype=power.dtype)
    cmnd = diff * lags / torch.clamp(torch.cumsum(diff, dim=-1), min=1e-12)  # YIN's normalised difference
    sub = cmnd[..., LAG_MIN - 1:]  # lags LAG_MIN..LAG_MAX
    idx = torch.arange(sub.shape[-1], device=power.device)
    below = (sub < YIN_THRESHOLD).to(power.dtype)
    first = torch.argmax(below, dim=-1, keepdim=True)  # the first lag below the threshold (0 if none)
    # from there, down to the local minimum: the first lag not followed by a lower one
    rising = torch.cat([sub[..., 1:] >= sub[..., :-1], torch.ones_like(sub[..., :1], dtype=torch.bool)], dim=-1)
    stop = (rising & (idx >= first)).to(power.dtype)
    j = torch.where(below.amax(-1) > 0, torch.argmax(stop, dim=-1), torch.argmin(sub, dim=-1))  # (B, T)
    voicing = torch.gather(r[..., LAG_MIN:], -1, j[..., None])[..., 0] / (r0[..., 0] + 1e-12)
    return j + LAG_MIN, voicing


def lagged(noisy: torch.Tensor, lag: torch.Tensor, n_fft: int) -> torch.Tensor:
    """noisy (B, T, LAG_MAX + n_fft): per frame, its window's samples (the last n_fft) and the LAG_MAX
    before them; lag (B, T). Returns the window `lag` samples earlier (B, T, n_fft), unwindowed."""
    idx = (LAG_MAX - lag)[..., None] + torch.arange(n_fft, device=noisy.device)  # (B, T, n_fft)
    return torch.gather(noisy, -1, idx)


def comb(cfg: ModelConfig, x: torch.Tensor, p: torch.Tensor, gain: torch.Tensor, voiced: torch.Tensor,
         member: torch.Tensor, interp: torch.Tensor) -> torch.Tensor:
    """x, p (B, T, 2F) [re | im]: the noisy frames and the frames one pitch period earlier; gain
    (B, T, F): the gains that will apply to the result; voiced (B, T) 0/1. Returns X' (B, T, 2F)."""
    f = cfg.n_freqs
    xr, xi, pr, pi = x[..., :f], x[..., f:], p[..., :f], p[..., f:]
    px = xr * xr + xi * xi
    e_x = px @ member  # (B, T, NB)
    e_p = (pr * pr + pi * pi) @ member
    c = ((xr * pr + xi * pi) @ member) / torch.sqrt(e_x * e_p + 1e-12)
    g2 = ((gain * gain * px) @ member) / (e_x + 1e-12)
    ratio = c * c * (1.0 - g2) / (1e-3 + g2 * (1.0 - c * c))
    r = torch.where(c * c > g2, torch.ones_like(ratio), torch.clamp(ratio, 0.0, 1.0))  # c > g (c > 0 below)
    r = torch.sqrt(r) * torch.sqrt(e_x / (e_p + 1e-8)) * cfg.pitch_filter
    r = torch.where(c > 0, r, torch.zeros_like(r)) * voiced[..., None]
    rf = r @ interp  # (B, T, F)
    yr, yi = xr + rf * pr, xi + rf * pi
    e_y = (yr * yr + yi * yi) @ member
    norm = torch.sqrt(e_x / (e_y + 1e-8)) @ interp
    return torch.cat([yr * norm, yi * norm], dim=-1)


# noisy samples per frame the filter reads: the frame's window and LAG_MAX before it (n_fft 512)
HISTORY = LAG_MAX + 512
CHUNK_FRAMES = 128  # frames per chunk offline


class Constants:
    """The filter's fixed tensors: the DFT basis, the bands, the autocorrelation basis."""

    def __init__(self, cfg: ModelConfig, device=None):
        from .features import dft_bases, window

        member, interp = bands(cfg)
        self.fwd = torch.from_numpy(dft_bases(cfg.stft)[0]).to(device)
        self.member, self.interp = torch.from_numpy(member).to(device), torch.from_numpy(interp).to(device)
        self.acf = torch.from_numpy(acf_basis(cfg, window(cfg.stft).numpy())).to(device)


def apply(cfg: ModelConfig, x: torch.Tensor, gain: torch.Tensor, noisy_hist: torch.Tensor, k) -> torch.Tensor:
    """x (B, T, 2F) [re | im]: the noisy frames the gains (B, T, F) apply to; noisy_hist (B, T,
    HISTORY): per frame, the noisy input of its window and the LAG_MAX samples before; k: the
    `Constants` (or an object holding them under the same names). Returns the filtered frames
    (B, T, 2F)."""
    f = cfg.n_freqs
    power = (x[..., :f] * x[..., :f] + x[..., f:] * x[..., f:]) * gain * gain
    lag, voicing = yin(power, k.acf)
    voiced = (voicing > cfg.pitch_filter_voicing).to(x.dtype)
    p = lagged(noisy_hist, lag, cfg.stft.n_fft) @ k.fwd
    return comb(cfg, x, p, gain, voiced, k.member, k.interp)


def frames_at(signal: torch.Tensor, n_frames: int, hop: int) -> torch.Tensor:
    """(B, N) -> (B, n_frames, HISTORY): the HISTORY samples from t * hop, frame t."""
    idx = torch.arange(n_frames, device=signal.device)[:, None] * hop + torch.arange(HISTORY, device=signal.device)
    return signal[:, idx]


@torch.no_grad()
def filter_offline(cfg: ModelConfig, wav: torch.Tensor, spec: torch.Tensor, gains: torch.Tensor) -> torch.Tensor:
    """The offline reference: wav (B, N) the noisy input; spec (B, T, F) complex, its frames
    (`features.stft`); gains (B, T, F) the gains that apply to them. Returns the filtered spectrum
    (B, T, F) complex, as the step graph computes it frame by frame."""
    hop, t = cfg.stft.hop, spec.shape[1]
    if cfg.pitch_filter <= 0 or t == 0:
        return spec
    k = Constants(cfg, spec.device)
    # frame t's noisy window is [t*hop - hop, t*hop + hop); its history starts LAG_MAX before
    lead = LAG_MAX + hop
    noisy = torch.nn.functional.pad(wav.float(), (lead, max(0, t * hop + hop - wav.shape[-1])))
    x = torch.cat([spec.real, spec.imag], dim=-1).float()
    out = []
    for s in range(0, t, CHUNK_FRAMES):
        n = min(CHUNK_FRAMES, t - s)
        out.append(apply(cfg, x[:, s:s + n], gains[:, s:s + n].float(), frames_at(noisy[:, s * hop:], n, hop), k))
    y = torch.cat(out, dim=1)
    f = cfg.n_freqs
    return torch.complex(y[..., :f], y[..., f:])
