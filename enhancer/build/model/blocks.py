"""Encoder blocks: the ordinary Transformer block and the TIM block (paper, Algorithm 1).

One class serves both: a block with one mechanism and no competition is an ordinary post-norm
Transformer block; with n_s > 1 mechanisms it is a TIM block:

1. competition   c = softmax over mechanisms of GroupLinear(h, d_mech -> 1)   (TIM-Comp only)
2. mechanism-wise self-attention (heads divide among mechanisms, grouped Q/K/V/O),
   h = norm(h + c * M) with a per-mechanism norm
3. inter-mechanism attention (2 heads x 32 units) across mechanisms at each position
4. mechanism-wise FFN, h = norm(h + F)

Self-attention is causal and limited to a window of W frames. `forward` runs a whole sequence;
`step` runs T consecutive frames (T = 1 when live) against a key/value ring buffer of W slots,
frame p's key/value at slot `p % W`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig
from .layers import GroupedLinear, GroupLayerNorm, attend, masked_softmax, window_mask
from .live import live_step


def ring_bias(pos: torch.Tensor, window: int, t: int = 1) -> torch.Tensor:
    """(B, 1, T, W) additive attention bias over the ring slots for the T frames pos..pos+T-1 of a
    call (pos: (B,)). Slot j holds frame pos - W + a, a = (j - pos) mod W, if it was ever written
    (j < pos); frame pos + i may see it if it is less than W frames back: a > i."""
    slots = torch.arange(window, device=pos.device)[None, None, :]  # (1, 1, W)
    rows = torch.arange(t, device=pos.device)[None, :, None]  # (1, T, 1)
    p = pos[:, None, None]  # (B, 1, 1)
    valid = (slots < p) & (torch.remainder(slots - p, window) > rows)  # (B, T, W)
    return torch.where(valid, 0.0, float("-inf"))[:, None]


def chunk_bias(t: int, window: int, device=None) -> torch.Tensor:
    """(T, T) additive attention bias among the frames of one call: 0 where frame i may attend
    frame j (i - W < j <= i, as `window_mask`), -inf elsewhere."""
    keep = window_mask(t, window, device)
    return torch.zeros(keep.shape, device=device).masked_fill(~keep, float("-inf"))


class EncoderBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, mechanisms: int, competition: bool):
        super().__init__()
        g = mechanisms
        self.g, self.dm = g, cfg.d_model // g
        self.heads_per_mech = cfg.n_heads // g
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.window, self.slope = cfg.attention_window, cfg.leaky_slope
        hd = self.heads_per_mech * self.head_dim  # = dm
        self.competition = GroupedLinear(g, self.dm, 1) if competition and g > 1 else None
        self.qkv = GroupedLinear(g, self.dm, 3 * hd)
        self.out = GroupedLinear(g, hd, self.dm)
        self.norm_attn = GroupLayerNorm(g, self.dm)
        if g > 1:
            self.inter_heads, self.inter_dim = cfg.inter_heads, cfg.inter_head_dim
            self.inter_qkv = GroupedLinear(g, self.dm, 3 * cfg.inter_heads * cfg.inter_head_dim)
            self.inter_out = GroupedLinear(g, cfg.inter_heads * cfg.inter_head_dim, self.dm)
            self.norm_inter = GroupLayerNorm(g, self.dm)
        self.ffn_in = GroupedLinear(g, self.dm, cfg.d_ffn // g)
        self.ffn_out = GroupedLinear(g, cfg.d_ffn // g, self.dm)
        self.norm_ffn = GroupLayerNorm(g, self.dm)
        self.drop = nn.Dropout(cfg.dropout)
        # 1/sqrt(dh) on the queries of the step graph: folded into the QKV weights when it is a power
        # of two (exact, so float16 weight storage stays exact), else one multiply per step
        scale = self.head_dim ** -0.5
        folded = math.log2(scale).is_integer()
        self.step_scale = 1.0 if folded else scale  # what `step` still multiplies the queries by
        q_scale = torch.cat([torch.full((hd,), scale / self.step_scale), torch.ones(2 * hd)])
        self.register_buffer("q_scale", q_scale, persistent=False)  # (3 * hd,)

    # ------------------------------------------------------------------ shared pieces
    def _compete(self, h: torch.Tensor) -> torch.Tensor | None:
        if self.competition is None:
            return None
        return torch.softmax(self.competition(h), dim=-2)  # (B, T, G, 1)

    def _qkv(self, h: torch.Tensor):
        b, t = h.shape[:2]
        qkv = self.qkv(h).view(b, t, self.g, 3, self.heads_per_mech, self.head_dim)  # (B, T, G, 3, Hg, dh)
        qkv = qkv.permute(3, 0, 2, 4, 1, 5).reshape(3, b, self.n_heads, t, self.head_dim)  # (3, B, H, T, dh)
        return qkv[0], qkv[1], qkv[2]

    def _after_attention(self, h: torch.Tensor, m: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
        """h, m: (..., G, dm) with m the attention read-out of each mechanism's heads."""
        m = self.out(m)  # (..., G, dm)
        if c is not None:
            m = c * m
        h = self.norm_attn(h + self.drop(m))
        if self.g > 1:
            h = self.norm_inter(h + self.drop(self._inter(h)))
        f = self.ffn_out(F.leaky_relu(self.ffn_in(h), self.slope))
        return self.norm_ffn(h + self.drop(f))  # (..., G, dm)

    def _inter(self, h: torch.Tensor) -> torch.Tensor:
        """Attention across mechanisms at each position (mechanisms play the role of positions)."""
        g, hc, dc = self.g, self.inter_heads, self.inter_dim
        qkv = self.inter_qkv(h).reshape(-1, g, 3, hc, dc).permute(2, 0, 3, 1, 4)  # (3, N, Hc, G, dc)
        s = (qkv[0] @ qkv[1].transpose(-1, -2)) * (dc ** -0.5)  # (N, Hc, G, G)
        m = (torch.softmax(s, dim=-1) @ qkv[2]).transpose(1, 2)  # (N, G, Hc, dc)
        m = m.reshape(h.shape[:-1] + (hc * dc,)) if h.dim() > 3 else m.reshape(-1, g, hc * dc)
        return self.inter_out(m)  # (..., G, dm)

    # ------------------------------------------------------------------ whole sequence
    def forward(self, x: torch.Tensor, mask: torch.Tensor):
        """x: (B, T, d_model), mask: (T, T) bool -> (B, T, d_model), competition (B, T, G) or None."""
        b, t, _ = x.shape
        h = x.view(b, t, self.g, self.dm)
        c = self._compete(h)
        q, k, v = self._qkv(h)  # (B, H, T, dh)
        m = attend(q, k, v, mask)  # (B, H, T, dh)
        m = m.view(b, self.g, self.heads_per_mech, t, self.head_dim).permute(0, 3, 1, 2, 4)  # (B, T, G, Hg, dh)
        h = self._after_attention(h, m.reshape(b, t, self.g, self.dm), c)
        return h.reshape(b, t, -1), (None if c is None else c[..., 0])

    # ------------------------------------------------------------------ T frames against the ring
    def _step_qkv(self, h: torch.Tensor, t: int):
        """h (B*T, d_model) or (B*T, G, dm) -> q (scaled unless `step_scale` != 1), k, v, each
        (B, H, T, dh), heads mechanism-major."""
        g, hd, nh = self.g, self.head_dim, self.n_heads
        w, bias = self.qkv.weight * self.q_scale, self.qkv.bias * self.q_scale  # constants of the graph
        if g == 1:
            y = F.linear(h, w[0].t(), bias[0])  # (B*T, 3 * hd): one Gemm
            y = y.reshape(-1, t, 3 * nh, hd)  # (B, T, 3H, dh)
        else:
            y = h.transpose(0, 1) @ w + bias[:, None, :]  # (G, B*T, 3 * dm)
            y = y.reshape(g, -1, t, 3, self.heads_per_mech, hd).permute(1, 2, 3, 0, 4, 5)  # (B, T, 3, G, Hg, dh)
            y = y.reshape(-1, t, 3 * nh, hd)
        return y.transpose(1, 2).split(nh, dim=1)  # (B, H, T, dh) each

    def step(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
             bias: torch.Tensor | None = None, causal: torch.Tensor | None = None):
        """T consecutive frames of B streams against the key/value ring buffer of this layer.

        x: (B*T, d_model), stream-major; k/v_cache: (B, H, W, dh), slot `p % W` holding frame p's
        key/value for the W most recent frames p < pos; pos: (B,) int64 index of the first frame.
        The caches are only read: the frames' own keys/values are returned as rows (B, H, T, dh) for
        the caller to write into slots `(pos + t) % W` in place (a graph output would be a full copy).
        Returns y (B*T, d_model), k_rows, v_rows, competition (B*T, G) or None.
        `bias` (B, 1, T, W): `ring_bias`; `causal` (T, T): `chunk_bias`; layers of one call share
        them. Written with few operators: at T = 1 and batch 1 the time is mostly per-operator overhead.
        T = 1 runs `enhancer.build.model.live.live_step` (the same function, laid out for one frame).
        """
        g, w = self.g, self.window
        if bias is None or causal is None:
            t = x.shape[0] // pos.shape[0]
            bias, causal = ring_bias(pos, w, t), chunk_bias(t, w, x.device)
        t = causal.shape[0]
        if t == 1:  # the live step
            return live_step(self, x, k_cache, v_cache, bias)
        h = x.reshape(-1, g, self.dm) if g > 1 else x  # (B*T, G, dm), or (B*T, d_model) for an ordinary block
        c = None if self.competition is None else torch.softmax(self.competition(h), dim=1)  # (B*T, G, 1)
        q, k, v = self._step_qkv(h, t)  # (B, H, T, dh)
        if self.step_scale != 1.0:
            q = q * self.step_scale
        # the ring's keys/values and the call's own side by side (W + T rows: fewer bytes to copy than
        # the (T, W + T) scores would be), one product each
        keys_t = torch.cat([k_cache.transpose(-1, -2), k.transpose(-1, -2)], dim=-1)  # (B, H, dh, W+T)
        mask = torch.cat([bias, causal.expand(bias.shape[0], 1, t, t)], dim=-1)  # (B, 1, T, W+T)
        p = masked_softmax(q @ keys_t + mask)  # (B, H, T, W+T)
        m = p @ torch.cat([v_cache, v], dim=2)  # (B, H, T, dh)
        m = m.transpose(1, 2).reshape((-1, self.dm) if g == 1 else (-1, g, self.dm))  # (B*T, [G,] dm)
        h = self._after_attention(h, m, c)  # like h
        return h.reshape(-1, g * self.dm) if g > 1 else h, k, v, (None if c is None else c.reshape(-1, g))
