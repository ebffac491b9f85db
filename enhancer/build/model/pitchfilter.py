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
CORR_N1, CORR_N2 = 16, 52  # CORR_FFT = N1 * N2: the DFTs in two stages (Cooley-Tukey), 4.5x fewer products than one
CORR_ROWS = -(-(LAG_MAX + 1) // CORR_N1)  # the lags 0..LAG_MAX come back as rows of N1 lags


def correlation_bases(window: np.ndarray) -> tuple[np.ndarray, ...]:
    """Real matrices for two correlations over a history h of N = CORR_FFT samples, at lags u = 0..LAG_MAX:
    sum_i h[LAG_MAX - u + i] k[i] with the frame's kernel k (the windowed frame, zero after n =
    len(window) samples), and the windowed energies sum_i h[LAG_MAX - u + i]^2 window[i]^2 (the same
    correlation of h^2 with window^2). Both are products of DFTs, computed in two stages (Cooley-Tukey,
    sample n = n1 + N1 n2, bin k = k2 + N2 k1, lag u = u1 + N1 u2), every constant a right operand:

    - `c1` (N2, 2 N2): the N2-point DFTs over n2, columns [re | im] of k2;
    - `m2` (N2, 2 N1, 2 N1): per k2, the twiddle exp(-2 pi j n1 k2 / N) and the N1-point DFT over n1,
      [re | im] in and out;
    - `m3` (N2, 2 N1, 2 N1): per k2, from the product spectrum P = H conj(K) over k1 to u1 (with the
      shift by LAG_MAX that puts the lags in order); `m3e` the same from h^2's spectrum, times
      conj(DFT(window^2)) first;
    - `c4` (2 N2, CORR_ROWS): from [re | im] of k2 to u2, the real part."""
    big, n1, n2 = CORR_FFT, CORR_N1, CORR_N2
    i1, i2 = np.arange(n1), np.arange(n2)

    def complex_matrix(angle):  # (..., a, b) angles -> (..., 2a, 2b): [re | im] rows in, [re | im] columns out
        c, s = np.cos(angle), np.sin(angle)
        return np.concatenate([np.concatenate([c, s], -1), np.concatenate([-s, c], -1)], -2)

    a1 = -2.0 * np.pi * np.outer(i2, i2) / n2
    c1 = np.concatenate([np.cos(a1), np.sin(a1)], axis=1)
    m2 = complex_matrix(-2.0 * np.pi * (i1[None, :, None] * i2[:, None, None] / big + np.outer(i1, i1)[None] / n1))
    k = i2[:, None, None] + n2 * i1[None, :, None]  # (N2, k1, 1): the bin
    m3 = complex_matrix(2.0 * np.pi * (k * LAG_MAX / big - i1[None, None, :] * (i1[None, :, None] / n1 + i2[:, None, None] / big)))
    w2 = np.fft.fft(np.asarray(window, np.float64) ** 2, big)[(i2[:, None] + n2 * i1[None, :])]  # (N2, k1)
    cr, ci = w2.real[..., None], -w2.imag[..., None]  # conj(W2): times it, then m3
    m3e = np.concatenate([cr * m3[:, :n1] + ci * m3[:, n1:], cr * m3[:, n1:] - ci * m3[:, :n1]], axis=1)
    a4 = 2.0 * np.pi * np.outer(i2, np.arange(CORR_ROWS)) / n2
    c4 = np.concatenate([np.cos(a4), np.sin(a4)]) / big
    return tuple(a.astype(np.float32) for a in (c1, m2, m3, m3e, c4))


def correlate(history: torch.Tensor, kernel: torch.Tensor, c1, m2, m3, m3e, c4,
              frames: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """history, kernel (..., CORR_FFT): the correlations of `correlation_bases` at lags 0..LAG_MAX,
    (..., LAG_MAX + 1) each: of the history with the kernel, and the history's windowed energies.
    `frames`: T of a (B, T, CORR_FFT) history when it is fixed (the output's shape then a constant)."""
    n1, n2 = CORR_N1, CORR_N2
    # (every transpose swaps the last two axes or keeps the last one: onnxruntime's fast paths)
    x = torch.stack([history, kernel, history * history], dim=-2).reshape(-1, n2, n1).transpose(1, 2)  # (rows, n1, n2)
    a = (x.reshape(-1, n2) @ c1).reshape(-1, n1, 2 * n2).transpose(1, 2).reshape(-1, 2, n2, n1)  # (rows, re / im, k2, n1)
    spec = (a.permute(2, 0, 1, 3).reshape(n2, -1, 2 * n1) @ m2).reshape(n2, -1, 3, 2 * n1)  # (N2, frames, row, [re | im] k1)
    hr, hi, kr, ki = spec[:, :, 0, :n1], spec[:, :, 0, n1:], spec[:, :, 1, :n1], spec[:, :, 1, n1:]
    q = torch.cat([torch.cat([hr * kr + hi * ki, hi * kr - hr * ki], dim=-1) @ m3, spec[:, :, 2] @ m3e], dim=1)
    q = q.reshape(n2, -1, 2, n1).permute(1, 2, 0, 3).reshape(-1, 2 * n2, n1).transpose(1, 2)  # (2 frames, u1, [re | im] k2)
    lags = (q.reshape(-1, 2 * n2) @ c4).reshape(-1, n1, CORR_ROWS).transpose(1, 2)  # (2 frames, u2, u1)
    lags = lags.reshape(2, *((-1, frames) if frames else history.shape[:-1]), CORR_ROWS * n1)
    return lags[0, ..., :LAG_MAX + 1], lags[1, ..., :LAG_MAX + 1]


def yin(history: torch.Tensor, window: torch.Tensor, c1, m2, m3, m3e, c4,
        frames: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """history (B, T, LAG_MAX + n_fft): for each frame, the samples of the window to analyse (the
    last n_fft) and the LAG_MAX before them; `c1`..`c4`: `correlation_bases(window)`; `frames`: T if fixed.
    Returns the pitch lag (B, T) int64 in [LAG_MIN, LAG_MAX] and the normalised correlation (B, T)
    of the windowed frame with the windowed frame one lag earlier (the voicing)."""
    # the windowed frame times the window: sum_i h[s + i] w[i] * cur[i] w[i] is the correlation at shift s
    kernel = torch.nn.functional.pad(history[..., LAG_MAX:] * window * window, (0, LAG_MAX))
    by_lag, energy = correlate(history, kernel, c1, m2, m3, m3e, c4, frames)  # (B, T, LAG_MAX + 1) each: lags 0..LAG_MAX
    corr = by_lag[..., 1:]  # lags 1..LAG_MAX
    e_past = energy[..., 1:].clamp(min=0.0)  # of the window one lag earlier
    e_cur = energy[..., :1].clamp(min=0.0)
    diff = torch.clamp(e_cur + e_past - 2.0 * corr, min=0.0)
    lags = torch.arange(1, LAG_MAX + 1, device=history.device, dtype=history.dtype)
    cmnd = diff * lags / torch.clamp(torch.cumsum(diff, dim=-1), min=1e-12)  # YIN's normalised difference
    sub = cmnd[..., LAG_MIN - 1:]  # lags LAG_MIN..LAG_MAX
    idx = torch.arange(LAG_MAX - LAG_MIN + 1, device=history.device)
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


CONSTANTS = ("window", "member", "interp", "corr_c1", "corr_m2", "corr_m3", "corr_m3e", "corr_c4")  # a step graph's copies (and `fwd`)


class Constants:
    """The filter's fixed tensors: the analysis window, the DFT basis, the bands, the correlation bases."""

    def __init__(self, cfg: ModelConfig, device=None):
        from .features import dft_bases, window

        member, interp = bands(cfg)
        win = window(cfg.stft, device).float()
        self.window = win
        self.fwd = torch.from_numpy(dft_bases(cfg.stft)[0]).to(device)
        self.member, self.interp = torch.from_numpy(member).to(device), torch.from_numpy(interp).to(device)
        bases = (torch.from_numpy(a).to(device) for a in correlation_bases(win.cpu().numpy()))
        self.corr_c1, self.corr_m2, self.corr_m3, self.corr_m3e, self.corr_c4 = bases


def apply(cfg: ModelConfig, x: torch.Tensor, gain: torch.Tensor, noisy_hist: torch.Tensor, plain_hist: torch.Tensor,
          k, frames: int | None = None) -> torch.Tensor:
    """x (B, T, 2F) [re | im]: the noisy frames the gains (B, T, F) apply to; noisy_hist (B, T,
    HISTORY): per frame, the noisy input of its window and the LAG_MAX samples before; plain_hist
    (B, T, HISTORY): the enhanced output without the filter that ends where the frame's first hop of
    output does (the previous frame's window and the LAG_MAX samples before); k: the `Constants`
    (or a module holding them under the same names); frames: T when fixed. Returns the filtered frames (B, T, 2F)."""
    lag, voicing = yin(plain_hist, k.window, k.corr_c1, k.corr_m2, k.corr_m3, k.corr_m3e, k.corr_c4, frames)
    voiced = (voicing > cfg.pitch_filter_voicing).to(x.dtype)
    p = lagged(noisy_hist, lag, cfg.stft.n_fft) @ k.fwd
    return comb(cfg, x, p, gain, voiced, k.member, k.interp)


def frames_at(signal: torch.Tensor, n_frames: int, hop: int) -> torch.Tensor:
    """(B, N) -> (B, n_frames, HISTORY): the HISTORY samples from t * hop, frame t (copies of whole
    hops, not a gather of every sample)."""
    if n_frames == 1:
        return signal[:, None, :HISTORY]
    per = -(-HISTORY // hop)  # hops a frame reaches into
    short = (n_frames - 1 + per) * hop - signal.shape[1]  # (the same at any n_frames in the step graph)
    signal = torch.nn.functional.pad(signal, (0, short)) if short > 0 else signal[:, :signal.shape[1] + short]
    hops = signal.reshape(signal.shape[0], -1, hop)  # (B, n_frames - 1 + per, hop)
    return torch.cat([hops[:, i:(i + 1 - per) or None] for i in range(per)], dim=-1)[..., :HISTORY]


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
