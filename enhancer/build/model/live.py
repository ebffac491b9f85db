"""The live step of an encoder block: one frame per stream (T = 1) against its key/value ring.

The same function as `EncoderBlock.step`, written for the live body of the step graph: a TIM
block's mechanisms run as separate dense layers on their slices of the features (one Gemm with
fused bias per mechanism, and a per-mechanism LayerNorm as one node) instead of batched matmuls
over a (mechanisms, streams) layout with transposes around them; the frame's heads are a reshape
(T = 1 needs no transposes); its own key/value are single rows, so their attention term is
elementwise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .layers import masked_softmax


def _linear(layer, x: torch.Tensor, i: int, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None):
    """Mechanism `i`'s map of GroupedLinear `layer` on x (B, d_in) -> (B, d_out)."""
    w = layer.weight if weight is None else weight
    b = layer.bias if bias is None else bias
    return F.linear(x, w[i].t(), None if b is None else b[i])


def _norm(norm, x: torch.Tensor, i: int) -> torch.Tensor:
    return F.layer_norm(x, (norm.dim,), norm.weight[i], norm.bias[i], norm.eps)


def live_step(block, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bias: torch.Tensor):
    """x (B, d_model), k/v_cache (B, H, W, dh), bias (B, 1, 1, W) (`ring_bias` at T = 1) ->
    y (B, d_model), k, v (B, H, 1, dh), competition (B, G) or None: `block.step` at T = 1."""
    g, dm, nh, dh, w = block.g, block.dm, block.n_heads, block.head_dim, block.window
    qkv_w, qkv_b = block.qkv.weight * block.q_scale, block.qkv.bias * block.q_scale  # constants of the graph
    hs = list(x.split(dm, dim=1)) if g > 1 else [x]  # each mechanism's features (B, dm)
    c = None
    if block.competition is not None:
        c = torch.softmax(torch.cat([_linear(block.competition, h, i) for i, h in enumerate(hs)], dim=1), dim=1)  # (B, G)
    qkv = [_linear(block.qkv, h, i, qkv_w, qkv_b).reshape(-1, 3, block.heads_per_mech, dh) for i, h in enumerate(hs)]
    qkv = qkv[0] if g == 1 else torch.cat(qkv, dim=2)  # (B, 3, H, dh): heads mechanism-major
    q, k, v = qkv.reshape(-1, 3 * nh, 1, dh).split(nh, dim=1)  # (B, H, 1, dh)
    if block.step_scale != 1.0:  # per head, not a scalar: onnxruntime would fold a scalar into the ring
        # matmul as its alpha, and a matmul with alpha != 1 misses its one-row kernel (twice the time)
        q = q * torch.full((1, nh, 1, 1), block.step_scale)
    s_ring = q @ k_cache.transpose(-1, -2) + bias  # (B, H, 1, W)
    p = masked_softmax(torch.cat([s_ring, (q * k).sum(dim=-1, keepdim=True)], dim=-1))  # (B, H, 1, W+1)
    m = (p[..., :w] @ v_cache + p[..., w:] * v).reshape(-1, nh * dh)  # (B, d_model), mechanism i at columns i*dm..
    if g == 1:
        return block._after_attention(x, m, None), k, v, None
    out = [_linear(block.out, mi, i) for i, mi in enumerate(m.split(dm, dim=1))]
    if c is not None:
        out = [c[:, i:i + 1] * o for i, o in enumerate(out)]
    hs = [_norm(block.norm_attn, h + o, i) for i, (h, o) in enumerate(zip(hs, out))]
    inter = _inter(block, hs)
    hs = [_norm(block.norm_inter, h + o, i) for i, (h, o) in enumerate(zip(hs, inter))]
    ffn = [_linear(block.ffn_out, F.leaky_relu(_linear(block.ffn_in, h, i), block.slope), i) for i, h in enumerate(hs)]
    hs = [_norm(block.norm_ffn, h + f, i) for i, (h, f) in enumerate(zip(hs, ffn))]
    return torch.cat(hs, dim=1), k, v, c


def _inter(block, hs: list[torch.Tensor]) -> list[torch.Tensor]:
    """`EncoderBlock._inter` for one frame: attention across the mechanisms, per mechanism (B, dm)."""
    g, hc, dc = block.g, block.inter_heads, block.inter_dim
    qkv = torch.stack([_linear(block.inter_qkv, h, i) for i, h in enumerate(hs)], dim=1)  # (B, G, 3 * Hc * dc)
    qkv = qkv.reshape(-1, g, 3, hc, dc).permute(2, 0, 3, 1, 4)  # (3, B, Hc, G, dc)
    s = (qkv[0] @ qkv[1].transpose(-1, -2)) * (dc ** -0.5)  # (B, Hc, G, G)
    m = (torch.softmax(s, dim=-1) @ qkv[2]).transpose(1, 2).reshape(-1, g, hc * dc)  # (B, G, Hc * dc)
    return [_linear(block.inter_out, m[:, i], i) for i in range(g)]
