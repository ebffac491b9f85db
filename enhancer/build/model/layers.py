"""Building blocks: grouped (per-mechanism) linear layers and norms, and attention helpers."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class GroupedLinear(nn.Module):
    """Independent linear maps for G groups (mechanisms) as one batched einsum.

    weight: (G, d_in, d_out); input (..., G, d_in) -> output (..., G, d_out). With G = 1 this is an
    ordinary `nn.Linear`. Equivalent to a dense linear with a block-diagonal weight.
    """

    def __init__(self, groups: int, d_in: int, d_out: int, bias: bool = True):
        super().__init__()
        self.groups, self.d_in, self.d_out = groups, d_in, d_out
        self.weight = nn.Parameter(torch.empty(groups, d_in, d_out))
        self.bias = nn.Parameter(torch.zeros(groups, d_out)) if bias else None
        bound = 1.0 / math.sqrt(d_in)
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.groups == 1 and x.dim() == 2:  # one frame of an ordinary layer (B, d_in): one Gemm
            return F.linear(x, self.weight[0].t(), self.bias[0] if self.bias is not None else None)
        if x.shape[-2:] != (self.groups, self.d_in):
            raise ValueError(f"GroupedLinear expects (..., {self.groups}, {self.d_in}), got {tuple(x.shape)}")
        if self.groups == 1:
            y = x @ self.weight[0]  # (..., 1, d_out)
        elif x.dim() == 3:  # one frame (B, G, d_in): G matmuls of (B, d_in) @ (d_in, d_out)
            y = (x.transpose(0, 1) @ self.weight).transpose(0, 1)  # (B, G, d_out)
        else:
            y = torch.einsum("...gi,gio->...go", x, self.weight)  # (..., G, d_out)
        return y + self.bias if self.bias is not None else y

    def dense_weight(self) -> torch.Tensor:
        """The equivalent block-diagonal (G*d_in, G*d_out) matrix."""
        return torch.block_diag(*self.weight)


class GroupLayerNorm(nn.Module):
    """LayerNorm over each group's features separately, with per-group affine parameters."""

    def __init__(self, groups: int, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(groups, dim))
        self.bias = nn.Parameter(torch.zeros(groups, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., G, dim)
        if self.weight.shape[0] == 1:  # one group: a plain LayerNorm (one graph node)
            return F.layer_norm(x, (self.dim,), self.weight[0], self.bias[0], self.eps)
        return F.layer_norm(x, (self.dim,), eps=self.eps) * self.weight + self.bias


def window_mask(t: int, window: int, device=None) -> torch.Tensor:
    """(T, T) bool, True where query i may attend key j: i - window < j <= i."""
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    return (j <= i) & (j > i - window)


SOFTMAX_FLOOR = 80.0  # how far below its row's largest a score enters the step's softmax, at most


def masked_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis of attention scores whose masked entries are -inf, each score
    first lifted to at least its row's largest minus SOFTMAX_FLOOR. A weight exp(-80) = 1.8e-35 of the
    largest is as good as 0, and onnxruntime's softmax is 8 to 16 times slower on a row with scores
    below -87 (where float32's exp falls to subnormals): every row of the step has masked ones."""
    return torch.softmax(torch.maximum(scores, scores.amax(dim=-1, keepdim=True) - SOFTMAX_FLOOR), dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention with a boolean mask (True = keep). q: (..., Tq, d), k/v: (..., Tk, d)."""
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)  # (..., Tq, Tk)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # (..., Tq, d)
