"""Four-layer Conv1d pre-encoder (paper A.2): 1024, 512, 128, 256 channels, kernel 3, each followed
by LayerNorm and LeakyReLU. It replaces positional encoding.

All four convolutions are causal in *step time*; the model's lookahead is a pure delay: the output at
step s belongs to frame s - lookahead, so frame t sees input frames up to t + lookahead. This is the
same function as two centred and two causal layers (lookahead 2), but every layer keeps a plain
(K-1)-frame input tail as its streaming cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ConvLayer(nn.Module):
    def __init__(self, c_in: int, c_out: int, kernel: int, slope: float):
        super().__init__()
        self.kernel, self.slope = kernel, slope
        self.conv = nn.Conv1d(c_in, c_out, kernel)
        self.norm = nn.LayerNorm(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C_in) -> (B, T, C_out)
        y = self.conv(F.pad(x.transpose(1, 2), (self.kernel - 1, 0))).transpose(1, 2)
        return F.leaky_relu(self.norm(y), self.slope)

    def step(self, x: torch.Tensor, tail: torch.Tensor):
        """x: (B, C_in), tail: (B, K-1, C_in) -> y (B, C_out), new tail."""
        win = torch.cat([tail, x[:, None, :]], dim=1)  # (B, K, C_in)
        w = self.conv.weight.permute(0, 2, 1).reshape(self.conv.out_channels, -1)  # (C_out, K*C_in)
        y = F.linear(win.reshape(-1, self.kernel * self.conv.in_channels), w, self.conv.bias)  # (B, C_out)
        return F.leaky_relu(self.norm(y), self.slope), win[:, 1:]


class PreEncoder(nn.Module):
    def __init__(self, c_in: int, channels: tuple[int, ...], kernel: int, slope: float):
        super().__init__()
        dims = (c_in,) + tuple(channels)
        self.layers = nn.ModuleList(ConvLayer(a, b, kernel, slope) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def step(self, x: torch.Tensor, tails: list[torch.Tensor]):
        new = []
        for layer, tail in zip(self.layers, tails):
            x, t = layer.step(x, tail)
            new.append(t)
        return x, new
