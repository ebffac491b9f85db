"""Four-layer Conv1d pre-encoder (paper A.2): 1024, 512, 128, 256 channels, kernel 3, each followed
by LayerNorm and LeakyReLU. It replaces positional encoding.

All four convolutions are causal in *step time*; the model's lookahead is a pure delay: the output at
step s belongs to frame s - lookahead, so frame t sees input frames up to t + lookahead. This is the
same function as two centred and two causal layers (lookahead 2), but every layer keeps a plain
(K-1)-frame input tail as its streaming cache.
"""
from __future__ import annotations

import itertools

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
        """x: (B, T, C_in), tail: (B, K-1, C_in) -> y (B*T, C_out), new tail (the last K-1 inputs).

        The K shifted views of [tail | x] side by side make one Gemm of B*T rows."""
        k = self.kernel
        win = torch.cat([tail, x], dim=1)  # (B, K-1+T, C_in)
        if x.shape[1] == 1:  # one frame: its K views are the window itself
            cols = win.reshape(-1, 1, k * self.conv.in_channels)  # (B, 1, K*C_in)
        else:
            cols = torch.cat([win[:, i:i - (k - 1) or None] for i in range(k)], dim=-1) if k > 1 else win  # (B, T, K*C_in)
        w = self.conv.weight.permute(0, 2, 1).reshape(self.conv.out_channels, -1)  # (C_out, K*C_in)
        y = F.linear(cols.reshape(-1, k * self.conv.in_channels), w, self.conv.bias)  # (B*T, C_out)
        return F.leaky_relu(self.norm(y), self.slope), (win[:, -(k - 1):] if k > 1 else tail)


class PreEncoder(nn.Module):
    def __init__(self, c_in: int, channels: tuple[int, ...], kernel: int, slope: float):
        super().__init__()
        dims = (c_in,) + tuple(channels)
        self.layers = nn.ModuleList(ConvLayer(a, b, kernel, slope) for a, b in itertools.pairwise(dims))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def step(self, x: torch.Tensor, tails: list[torch.Tensor]):
        """x: (B, T, C_in), one tail per layer -> (B*T, C_out), new tails."""
        new, frames = [], x.shape[1]
        for i, (layer, tail) in enumerate(zip(self.layers, tails)):
            if i:  # (B, T, C): at one frame a constant shape
                c = layer.conv.in_channels
                x = x.reshape(-1, 1, c) if frames == 1 else x.reshape(tail.shape[0], -1, c)
            x, t = layer.step(x, tail)
            new.append(t)
        return x, new
