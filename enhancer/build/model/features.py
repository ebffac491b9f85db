"""Torch twins of `enhancer.signal` (same framing, window and features), used in training and
as the offline reference in tests."""
from __future__ import annotations

import numpy as np
import torch

from ...config import STFTConfig
from ...signal import n_frames_for, sqrt_hann


def window(cfg: STFTConfig = STFTConfig(), device=None) -> torch.Tensor:
    return torch.from_numpy(sqrt_hann(cfg.n_fft)).to(device)


def stft(x: torch.Tensor, cfg: STFTConfig = STFTConfig(), n_frames: int | None = None) -> torch.Tensor:
    """x: (..., n) -> complex (..., T, F), framing as `enhancer.signal.stft`."""
    n_frames = n_frames_for(x.shape[-1], cfg) if n_frames is None else n_frames
    end = (n_frames + 1) * cfg.hop - cfg.hop - x.shape[-1]
    if end < 0:
        raise ValueError("n_frames too small for the signal")
    lead = x.shape[:-1]
    xp = torch.nn.functional.pad(x.reshape(-1, x.shape[-1]), (cfg.hop, end))
    spec = torch.stft(xp, cfg.n_fft, cfg.hop, cfg.n_fft, window(cfg, x.device), center=False, return_complex=True)
    return spec.transpose(-1, -2).reshape(*lead, n_frames, cfg.n_freqs)  # (..., T, F)


def istft(spec: torch.Tensor, n_samples: int, cfg: STFTConfig = STFTConfig()) -> torch.Tensor:
    """Inverse of `stft`: complex (..., T, F) -> (..., n_samples)."""
    return overlap_add(spec, cfg)[..., cfg.hop:cfg.hop + n_samples]


def overlap_add(spec: torch.Tensor, cfg: STFTConfig = STFTConfig()) -> torch.Tensor:
    """complex (..., T, F) -> (..., (T + 1) * hop): every frame's samples, from one hop before the
    signal of `stft` starts (frame 0's first half)."""
    lead, t = spec.shape[:-2], spec.shape[-2]
    frames = torch.fft.irfft(spec.reshape(-1, t, cfg.n_freqs), n=cfg.n_fft) * window(cfg, spec.device)
    out = torch.nn.functional.fold(
        frames.transpose(1, 2), output_size=(1, (t + 1) * cfg.hop), kernel_size=(1, cfg.n_fft), stride=(1, cfg.hop)
    )  # (B, 1, 1, (T+1)*hop)
    return out.reshape(*lead, -1)


def log_magnitude(spec: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.log(spec.abs() + eps)


def dft_bases(cfg: STFTConfig = STFTConfig()) -> tuple[np.ndarray, np.ndarray]:
    """Real matrices for a windowed rfft and windowed irfft as matmuls (used by the step graph).

    forward: frame (n_fft,) @ fwd (n_fft, 2F) -> [re | im]
    inverse: [re | im] (2F,) @ inv (2F, n_fft) -> windowed time frame
    """
    n, f = cfg.n_fft, cfg.n_freqs
    w = sqrt_hann(n).astype(np.float64)
    t = np.arange(n)[:, None]
    k = np.arange(f)[None, :]
    ang = 2.0 * np.pi * t * k / n  # (n, F)
    fwd = np.concatenate([w[:, None] * np.cos(ang), -w[:, None] * np.sin(ang)], axis=1)
    # irfft: x[t] = (1/n) * sum_k a_k (re_k cos - im_k sin), a_k = 1 for DC/Nyquist, else 2
    a = np.full(f, 2.0)
    a[0] = a[-1] = 1.0
    inv = np.concatenate([(a[:, None] * np.cos(ang.T)), -(a[:, None] * np.sin(ang.T))], axis=0) / n  # (2F, n)
    inv = inv * w[None, :]
    return fwd.astype(np.float32), inv.astype(np.float32)
