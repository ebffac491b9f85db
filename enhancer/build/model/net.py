"""The enhancement network: normalised log-magnitude in, bounded gain on the noisy magnitude out.

    logmag (B, T, F) -> normalise -> pre-encoder (4 conv) -> [proj] -> 8 encoder blocks -> linear -> sigmoid

The estimate of the clean log-magnitude is `log(gain * |X| + eps)`; the training loss is the MSE
between it and the clean log-magnitude (paper A.2; `training.objective`). Resynthesis uses the noisy phase.
"""
from __future__ import annotations

import torch
from torch import nn

from ...config import ModelConfig
from . import features, pitchfilter
from .blocks import EncoderBlock
from .layers import window_mask
from .postfilter import rise_limit
from .preencoder import PreEncoder

LIMIT_FRAMES = 512  # frames per chunk of the offline rise limit


class TIMNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        f = cfg.n_freqs
        self.register_buffer("feat_mean", torch.zeros(f))
        self.register_buffer("feat_std", torch.ones(f))
        self.pre = PreEncoder(f, cfg.conv_channels, cfg.kernel_size, cfg.leaky_slope)
        c_out = cfg.conv_channels[-1]
        self.proj = nn.Linear(c_out, cfg.d_model) if c_out != cfg.d_model else nn.Identity()
        self.blocks = nn.ModuleList(
            EncoderBlock(cfg, cfg.n_mechanisms, cfg.competition) if cfg.is_tim_layer(i) else EncoderBlock(cfg, 1, False)
            for i in range(cfg.n_layers)
        )
        self.head = nn.Linear(cfg.d_model, f)

    # ------------------------------------------------------------------ normalisation
    def set_normalization(self, mean, std) -> None:
        mean = torch.as_tensor(mean, dtype=torch.float32).reshape(-1)
        std = torch.as_tensor(std, dtype=torch.float32).reshape(-1)
        if mean.numel() != self.config.n_freqs or std.numel() != self.config.n_freqs:
            raise ValueError(f"normalisation statistics need {self.config.n_freqs} values per bin")
        if not torch.isfinite(mean).all() or not (std > 0).all():
            raise ValueError("normalisation statistics must be finite with std > 0")
        self.feat_mean.copy_(mean)
        self.feat_std.copy_(std)

    def normalize(self, logmag: torch.Tensor) -> torch.Tensor:
        return (logmag - self.feat_mean) / self.feat_std

    # ------------------------------------------------------------------ whole sequence
    def forward(self, logmag: torch.Tensor, pad_end: bool = True):
        """logmag: (B, T, F) noisy log(|X| + eps).

        Returns gains (B, T, F) in (0, 1) for frames 0..T-1 and the competition scores
        (B, T, n_tim_layers, n_s) (None without competition). Frame t depends on input frames
        <= t + lookahead only. With `pad_end` the last `lookahead` frames see silence as their
        future; with `pad_end=False` the output has T - lookahead frames and no padding is used.
        """
        cfg = self.config
        la = cfg.lookahead
        x = self.normalize(logmag)
        if pad_end and la:
            silence = torch.full_like(logmag[:, :la], torch.log(torch.tensor(cfg.log_eps)).item())
            x = torch.cat([x, self.normalize(silence)], dim=1)  # (B, T+L, F)
        x = self.proj(self.pre(x))  # (B, S, d_model); step s belongs to frame s - L
        mask = window_mask(x.shape[1], cfg.attention_window, x.device)
        comps = []
        for block in self.blocks:
            x, c = block(x, mask)
            if c is not None:
                comps.append(c)
        gains = torch.sigmoid(self.head(x[:, la:]))  # (B, T', F)
        comp = torch.stack(comps, dim=2)[:, la:] if comps else None  # (B, T', n_tim, n_s)
        return gains, comp

    def output_gain(self, gains: torch.Tensor, power: torch.Tensor | None = None) -> torch.Tensor:
        """The gains applied to the noisy spectrum: the network's gains (`forward`) through the rise
        limit (`enhancer.build.model.postfilter`; needs `power`, |X|^2 of the same frames, from the start
        of the stream) and raised to `gain_exponent`, before the attenuation limit."""
        cfg = self.config
        if cfg.rise_limit_gain > 0:
            if power is None:
                raise ValueError("the rise limit needs the power spectrum of the frames")
            state = [gains.new_zeros(gains.shape[0], gains.shape[-1]), gains.new_zeros(gains.shape[0], 2)]
            parts = []
            for s in range(0, gains.shape[1], LIMIT_FRAMES):  # chunks: its cost grows with T^2 per call
                part, *state = rise_limit(cfg, gains[:, s:s + LIMIT_FRAMES], power[:, s:s + LIMIT_FRAMES], *state)
                parts.append(part)
            gains = torch.cat(parts, dim=1) if parts else gains
        return self.sharpen(gains)

    def sharpen(self, gains: torch.Tensor) -> torch.Tensor:
        """`gains` raised to `gain_exponent`."""
        e = self.config.gain_exponent
        return gains if e == 1.0 else gains ** e

    # ------------------------------------------------------------------ waveform in, waveform out
    @torch.no_grad()
    def enhance(self, wav: torch.Tensor, min_gain: float = 0.0) -> torch.Tensor:
        """Offline reference: (B, N) -> (B, N), same framing and padding as the streaming step."""
        cfg = self.config
        n = wav.shape[-1]
        steps = -(-(cfg.delay_samples + n) // cfg.stft.hop)
        spec = features.stft(wav, cfg.stft, n_frames=steps)  # (B, S, F)
        gains, _ = self(features.log_magnitude(spec, cfg.log_eps), pad_end=False)  # (B, S-L, F)
        spec = spec[:, : gains.shape[1]]
        power = spec.real ** 2 + spec.imag ** 2 if self.config.rise_limit_gain > 0 else None
        gains = self.output_gain(gains, power).clamp_min(min_gain)
        if cfg.pitch_filter > 0:
            spec = pitchfilter.filter_offline(cfg, wav, spec, gains)
        return features.istft(spec * gains, n, cfg.stft)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

