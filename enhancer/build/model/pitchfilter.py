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

The pitch is estimated by YIN (de Cheveigne & Kawahara, 2002) on the enhanced output without the
pitch filter, in the last frame whose samples are complete when the gains of the frame to filter
are known (the frame before it), at lags of 32 to 320 samples (50 to 500 Hz). Both the estimate
and P read past samples only, so the model's latency is unchanged; the step graph carries the
recent noisy input and enhanced output without the filter, and that output's overlap-add tail
(state caches `pitch_x`, `pitch_y`, `pitch_ola`).
"""
from __future__ import annotations

import numpy as np
import torch

from ...config import ModelConfig
from ...step_io import PITCH_LAG_MAX

N_FFT = 512  # the frames the filter works on (`ModelConfig.validate` requires them)
LAG_MIN, LAG_MAX = 32, PITCH_LAG_MAX  # pitch lags searched, in samples at 16 kHz: 500 Hz down to 50 Hz
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


CORR_FFT = LAG_MAX + N_FFT  # the correlation with the frame is a product of DFTs this long (>= the history)


def correlation_bases(window: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Real matrices for, over a history h of LAG_MAX + n samples (n = len(window)):

    - the correlations sum_i h[s + i] k[i] at shifts s = 0..LAG_MAX with DFTs of CORR_FFT points:
      `fwd` (LAG_MAX + n, 2K) [re | im] of h (and of a kernel zero-padded as long), `inv` (2K,
      LAG_MAX + 1) from the product spectrum [re | im] back to the shifts;
    - the windowed energies sum_i h[s + i]^2 window[i]^2 from running sums: window^2 is the Hann
      window 0.5 - 0.5 cos(2 pi i / n), so with z = exp(2 pi j / n) the energy at shift s is
      0.5 sum h^2 - 0.5 Re(z^-s sum_m h[m]^2 z^m) over the n samples from s; `phase` (4, LAG_MAX + n)
      holds cos and sin of 2 pi m / n for every sample m (rows 0, 1) and of every shift (rows 2, 3,
      the first LAG_MAX + 1 columns)."""
    n, m = len(window), LAG_MAX + len(window)
    k = CORR_FFT // 2 + 1
    t = np.arange(m)[:, None]
    ang = 2.0 * np.pi * t * np.arange(k)[None, :] / CORR_FFT
    fwd = np.concatenate([np.cos(ang), -np.sin(ang)], axis=1)
    a = np.full(k, 2.0)
    a[0] = 1.0
    if CORR_FFT % 2 == 0:
        a[-1] = 1.0
    s = np.arange(LAG_MAX + 1)[None, :]
    ang_s = 2.0 * np.pi * np.arange(k)[:, None] * s / CORR_FFT
    inv = np.concatenate([a[:, None] * np.cos(ang_s), -a[:, None] * np.sin(ang_s)], axis=0) / CORR_FFT
    theta = 2.0 * np.pi * np.arange(m) / n
    shift = np.where(np.arange(m) <= LAG_MAX, theta, 0.0)
    phase = np.stack([np.cos(theta), np.sin(theta), np.cos(shift), np.sin(shift)])
    return fwd.astype(np.float32), inv.astype(np.float32), phase.astype(np.float32)


def yin(history: torch.Tensor, window: torch.Tensor, fwd: torch.Tensor, inv: torch.Tensor,
        phase: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """history (B, T, LAG_MAX + n_fft): for each frame, the samples of the window to analyse (the
    last n_fft) and the LAG_MAX before them; `fwd`, `inv`, `phase`: `correlation_bases(window)`.
    Returns the pitch lag (B, T) int64 in [LAG_MIN, LAG_MAX] and the normalised correlation (B, T)
    of the windowed frame with the windowed frame one lag earlier (the voicing)."""
    n = window.shape[0]
    # the windowed frame times the window: sum_i h[s + i] w[i] * cur[i] w[i] is the correlation at shift s
    kernel = torch.nn.functional.pad(history[..., LAG_MAX:] * window * window, (0, LAG_MAX))
    spec = torch.stack([history, kernel], dim=-2) @ fwd  # (B, T, 2, 2K): one pass over fwd
    k = spec.shape[-1] // 2
    hr, hi, kr, ki = spec[..., 0, :k], spec[..., 0, k:], spec[..., 1, :k], spec[..., 1, k:]
    by_shift = torch.cat([hr * kr + hi * ki, hi * kr - hr * ki], dim=-1) @ inv  # (B, T, LAG_MAX + 1): lag LAG_MAX - s
    # the windowed energies at every shift, from running sums of h^2 and h^2 z^m
    h2 = history * history
    sums = torch.cumsum(torch.nn.functional.pad(torch.stack([h2, h2 * phase[0], h2 * phase[1]], dim=-2), (1, 0)), -1)
    win_sums = sums[..., n:] - sums[..., :LAG_MAX + 1]  # (B, T, 3, LAG_MAX + 1): over the n samples from s
    cs, sn = phase[2, :LAG_MAX + 1], phase[3, :LAG_MAX + 1]
    energy = 0.5 * win_sums[..., 0, :] - 0.5 * (cs * win_sums[..., 1, :] + sn * win_sums[..., 2, :])
    corr = torch.flip(by_shift[..., :LAG_MAX], dims=[-1])  # lags 1..LAG_MAX
    e_past = torch.flip(energy[..., :LAG_MAX], dims=[-1]).clamp(min=0.0)
    e_cur = energy[..., LAG_MAX:].clamp(min=0.0)
    diff = torch.clamp(e_cur + e_past - 2.0 * corr, min=0.0)
    lags = torch.arange(1, LAG_MAX + 1, device=history.device, dtype=history.dtype)
    cmnd = diff * lags / torch.clamp(torch.cumsum(diff, dim=-1), min=1e-12)  # YIN's normalised difference
    sub = cmnd[..., LAG_MIN - 1:]  # lags LAG_MIN..LAG_MAX
    idx = torch.arange(sub.shape[-1], device=history.device)
    below = (sub < YIN_THRESHOLD).to(history.dtype)
    first = torch.argmax(below, dim=-1, keepdim=True)  # the first lag below the threshold (0 if none)
    # from there, down to the local minimum: the first lag not followed by a lower one
    rising = torch.nn.functional.pad(sub[..., 1:], (0, 1), value=float("inf")) >= sub
    stop = (rising & (idx >= first)).to(history.dtype)
    j = torch.where(below.amax(-1) > 0, torch.argmax(stop, dim=-1), torch.argmin(sub, dim=-1))  # (B, T)
    norm = corr / torch.sqrt(e_cur * e_past + 1e-12)
    voicing = torch.gather(norm[..., LAG_MIN - 1:], -1, j[..., None])[..., 0]
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
    r = torch.where(c * c > g2, 1.0, torch.clamp(ratio, 0.0, 1.0))  # c > g (c > 0 below)
    r = torch.sqrt(r) * torch.sqrt(e_x / (e_p + 1e-8)) * cfg.pitch_filter
    r = torch.where(c > 0, r, 0.0) * voiced[..., None]
    rf = r @ interp  # (B, T, F)
    yr, yi = xr + rf * pr, xi + rf * pi
    e_y = (yr * yr + yi * yi) @ member
    norm = torch.sqrt(e_x / (e_y + 1e-8)) @ interp
    return torch.cat([yr * norm, yi * norm], dim=-1)


HISTORY = LAG_MAX + N_FFT  # samples per frame the filter reads: the analysed window and LAG_MAX before it
CHUNK_FRAMES = 128  # frames per chunk offline


CONSTANTS = ("window", "member", "interp", "corr_fwd", "corr_inv", "corr_phase")  # a step graph's copies (and `fwd`)


class Constants:
    """The filter's fixed tensors: the analysis window, the DFT basis, the bands, the correlation bases."""

    def __init__(self, cfg: ModelConfig, device=None):
        from .features import dft_bases, window

        member, interp = bands(cfg)
        win = window(cfg.stft, device).float()
        self.window = win
        self.fwd = torch.from_numpy(dft_bases(cfg.stft)[0]).to(device)
        self.member, self.interp = torch.from_numpy(member).to(device), torch.from_numpy(interp).to(device)
        self.corr_fwd, self.corr_inv, self.corr_phase = (torch.from_numpy(a).to(device)
                                                        for a in correlation_bases(win.cpu().numpy()))


def apply(cfg: ModelConfig, x: torch.Tensor, gain: torch.Tensor, noisy_hist: torch.Tensor, plain_hist: torch.Tensor,
          k) -> torch.Tensor:
    """x (B, T, 2F) [re | im]: the noisy frames the gains (B, T, F) apply to; noisy_hist (B, T,
    HISTORY): per frame, the noisy input of its window and the LAG_MAX samples before; plain_hist
    (B, T, HISTORY): the enhanced output without the filter that ends where the frame's first hop of
    output does (the previous frame's window and the LAG_MAX samples before); k: the `Constants`
    (or a module holding them under the same names). Returns the filtered frames (B, T, 2F)."""
    lag, voicing = yin(plain_hist, k.window, k.corr_fwd, k.corr_inv, k.corr_phase)
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
    from .features import overlap_add

    hop, t = cfg.stft.hop, spec.shape[1]
    if cfg.pitch_filter <= 0 or t == 0:
        return spec
    k = Constants(cfg, spec.device)
    # frame t's noisy window is [t*hop - hop, t*hop + hop); its history starts LAG_MAX before
    lead = LAG_MAX + hop
    noisy = torch.nn.functional.pad(wav.float(), (lead, max(0, t * hop + hop - wav.shape[-1])))
    # the output without the filter, from -hop (frame 0's first half), complete up to t*hop once frame
    # t is added; frame t's history ends there
    plain = torch.nn.functional.pad(overlap_add(spec * gains, cfg.stft), (HISTORY - hop, 0))
    x = torch.cat([spec.real, spec.imag], dim=-1).float()
    out = []
    for s in range(0, t, CHUNK_FRAMES):
        n = min(CHUNK_FRAMES, t - s)
        nh = frames_at(noisy[:, s * hop:], n, hop)
        ph = frames_at(plain[:, s * hop:], n, hop)
        out.append(apply(cfg, x[:, s:s + n], gains[:, s:s + n].float(), nh, ph, k))
    y = torch.cat(out, dim=1)
    f = cfg.n_freqs
    return torch.complex(y[..., :f], y[..., f:])
