"""The streaming step graph: one 16 ms hop of audio in, one hop of enhanced audio out.

    step(hop, min_gain, pos, *state, *rings) -> (out, [competition], activity, kv_rows, *state)

Inputs (B = streams sharing the call; dynamic):
    hop        (B, 256) float32   the newest 16 ms of 16 kHz audio
    min_gain   (B,)     float32   gain floor (attenuation limit), 0 = none
    pos        (B,)     int64     index of this step in its stream (0 for a fresh stream)
State caches (returned updated, fixed shape, zero for a fresh stream), in this order:
    prev_hop   (B, 256)               previous hop (the first half of the analysis frame)
    spec_delay (B, L+1, 2F)           [re | im] of the last L+1 frames (the gain applies to the oldest)
    conv0..3   (B, K-1, C_in)         input tail of each pre-encoder convolution
    ola        (B, 256)               overlap-add tail of the previous output frame
Key/value ring buffers (read by the graph, written by the caller in place):
    k0..k7, v0..v7  (B, H, W, dh)     slot `p % W` holds frame p's key/value
Outputs: out (B, 256), the stream delayed by (L + 1) * 256 samples; competition (B, n_tim, n_s)
(models with competition only); activity (B,) mean gain over 300 Hz..4 kHz; kv_rows
(B, H, 2 * n_layers, dh), this frame's keys (layers 0..N-1) then values, which the caller writes
to slot `pos % W` of each ring (`write_rings`); then the new state caches.

A stateless graph returns fresh output buffers, so returning whole rings would copy every ring
every step (2.5 MB per stream for the default model); writing one row in place costs nothing.
The STFT and iSTFT are matmuls with fixed DFT bases, so the graph is self-contained.
"""
from __future__ import annotations

import torch
from torch import nn

from ..layout import has_competition, state_specs
from .blocks import ring_bias
from .features import dft_bases
from .net import TIMNet


class StreamingStep(nn.Module):
    def __init__(self, net: TIMNet):
        super().__init__()
        self.net = net
        cfg = net.config
        self.config = cfg
        fwd, inv = dft_bases(cfg.stft)
        self.register_buffer("fwd_basis", torch.from_numpy(fwd))
        self.register_buffer("inv_basis", torch.from_numpy(inv))
        f = cfg.n_freqs
        lo, hi = int(300 * cfg.stft.n_fft / cfg.stft.sample_rate), int(4000 * cfg.stft.n_fft / cfg.stft.sample_rate)
        self.speech_bins = (lo, hi + 1)
        self.n_conv = len(cfg.conv_channels)
        self.with_comp = has_competition(cfg)
        self.f = f

    def forward(self, hop, min_gain, pos, *caches):
        cfg, net, f = self.config, self.net, self.f
        n_state = len(state_specs(cfg))
        prev_hop, spec_delay, *tails, ola = caches[:n_state]
        rings = caches[n_state:]
        ks, vs = rings[: cfg.n_layers], rings[cfg.n_layers:]

        spec = torch.cat([prev_hop, hop], dim=-1) @ self.fwd_basis  # (B, 2F) = [re | im]
        re, im = spec[:, :f], spec[:, f:]
        logmag = torch.log(torch.sqrt(re * re + im * im) + cfg.log_eps)  # (B, F)
        x = net.normalize(logmag)  # (B, F)
        x, tails = net.pre.step(x, tails)
        x = net.proj(x)  # (B, d_model)
        k_rows, v_rows, comps = [], [], []
        bias = ring_bias(pos, cfg.window)  # (B, 1, 1, W), shared by the layers
        for block, k, v in zip(net.blocks, ks, vs):
            x, k_row, v_row, c = block.step(x, k, v, pos, bias)
            k_rows.append(k_row)
            v_rows.append(v_row)
            if c is not None:
                comps.append(c)
        gain = torch.sigmoid(net.head(x))  # (B, F)
        gain = torch.maximum(gain, min_gain[:, None])
        spec_delay = torch.cat([spec_delay[:, 1:], spec[:, None]], dim=1)  # (B, L+1, 2F)
        frame = (spec_delay[:, 0] * torch.cat([gain, gain], dim=-1)) @ self.inv_basis  # (B, n_fft)
        hop_n = cfg.stft.hop
        out = ola + frame[:, :hop_n]
        activity = gain[:, self.speech_bins[0]: self.speech_bins[1]].mean(dim=-1)  # (B,)
        kv_rows = torch.cat(k_rows + v_rows, dim=2)  # (B, H, 2N, dh): keys of layers 0..N-1, then values
        outs = [out] + ([torch.stack(comps, dim=1)] if self.with_comp else []) + [activity, kv_rows]
        return tuple(outs + [hop, spec_delay, *tails, frame[:, hop_n:]])
