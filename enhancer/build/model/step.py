"""The streaming step graph: T consecutive 16 ms hops of audio in, T hops of enhanced audio out.

    step(hops, min_gain, pos, *state, *rings) -> (out, [competition], activity, kv_rows, *state)

T (frames per call) is a dynamic axis of the one graph: T = 1 is the live step (one hop per stream
per call, streams batched), T > 1 runs a backlog or a file in chunks (every weight read once per
chunk, every matmul with B * T rows). Any chunking of a stream gives the same output. The exported
graph holds two traces of this module under one `If` on T (`enhancer.build.graph_switch`): the live step
traced at T = 1 (constant shapes, the frame's self-attention elementwise) and the step at any T.

Inputs (B = streams sharing the call, T = frames per call; both dynamic):
    hops       (B, T, 256) float32   the next T hops of 16 kHz audio of each stream
    min_gain   (B,)        float32   gain floor (attenuation limit), 0 = none
    pos        (B,)        int64     index in its stream of the first frame of the call (0 = fresh)
State caches (returned updated, fixed shape, zero for a fresh stream), in this order:
    prev_hop   (B, 256)               previous hop (the first half of the analysis frame)
    spec_delay (B, L+1, 2F)           [re | im] of the last L+1 frames (the gain applies to the oldest)
    conv0..3   (B, K-1, C_in)         input tail of each pre-encoder convolution
    ola        (B, 256)               overlap-add tail of the previous output frame
    prev_gain  (B, F)                 the network's gains of the previous frame   } models with the rise
    energy     (B, 2)                 running energies kept and removed            } limit only (`postfilter`)
    pitch_x    (B, HISTORY + (L-1)*256)  noisy input before the call's hops        } models with the pitch
    pitch_y    (B, HISTORY - 256)     output without the pitch filter, before the  } filter only
                                      call's first frame                           } (`pitchfilter`)
    pitch_ola  (B, 256)               overlap-add tail of that output              }
Key/value ring buffers (read by the graph, written by the caller in place):
    k0..k7, v0..v7  (B, H, W, dh)     slot `p % W` holds frame p's key/value
Outputs, named (`enhancer.step_io.output_names`; read them by name with `StepOutputs.decode`):
out (B, T, 256), the stream delayed by (L + 1) * 256 samples; competition (B, T, n_tim, n_s)
(models with competition only); activity (B, T) mean network gain over 300 Hz..4 kHz; kv_rows
(B, H, 2N * T, dh) with N = n_layers, i.e. (B, H, 2N, T, dh) flattened: the T frames' keys (layers
0..N-1) then values, which the caller writes to slots `(pos + t) % W` of the rings
(`enhancer.step_io.write_rings`); then the new state caches, `<name>_next`.

Inside a call, frame t attends causally to the chunk's frames t - W < t' <= t and to the ring
slots that hold frames pos + t - W < p < pos (`ring_bias`), so the window is the same as the
whole-sequence model's whatever T is. A stateless graph returns fresh output buffers, so returning
whole rings would copy every ring every call (2.5 MB per stream for the default model); writing T
rows in place costs next to nothing. The STFT and iSTFT are matmuls with fixed DFT bases, so the
graph is self-contained.
"""
from __future__ import annotations

import torch
from torch import nn

from ...step_io import has_competition, state_specs
from . import pitchfilter
from .blocks import chunk_bias, ring_bias
from .features import dft_bases
from .net import TIMNet
from .postfilter import rise_limit


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
        self.n_s = next((b.g for b in net.blocks if b.competition is not None), 0)  # competing mechanisms
        self.frames: int | None = None  # T while traced at a fixed T (the live body): its shapes are constants
        if cfg.pitch_filter > 0:  # the pitch filter's constants, under the names `pitchfilter.apply` reads
            k = pitchfilter.Constants(cfg)
            for name in pitchfilter.CONSTANTS:
                self.register_buffer("pitch_" + name, getattr(k, name))

    def forward(self, hops, min_gain, pos, *caches):
        cfg, net, f = self.config, self.net, self.f
        n_state = len(state_specs(cfg))
        n_conv = self.n_conv
        prev_hop, spec_delay = caches[:2]
        tails, ola, post = caches[2:2 + n_conv], caches[2 + n_conv], caches[3 + n_conv:n_state]
        rings = caches[n_state:]
        ks, vs = rings[: cfg.n_layers], rings[cfg.n_layers:]
        hop_n = cfg.stft.hop
        t = self.frames or hops.shape[1]

        x = torch.cat([prev_hop[:, None], hops], dim=1)  # (B, T+1, hop)
        frames = x.reshape(-1, 1, 2 * hop_n) if t == 1 else torch.cat([x[:, :-1], x[:, 1:]], dim=-1)  # (B, T, n_fft)
        spec = frames @ self.fwd_basis  # (B, T, 2F) = [re | im]
        re, im = spec[..., :f], spec[..., f:]
        logmag = torch.log(torch.sqrt(re * re + im * im) + cfg.log_eps)  # (B, T, F)
        x, tails = net.pre.step(net.normalize(logmag), tails)  # (B*T, C)
        x = net.proj(x)  # (B*T, d_model)
        k_rows, v_rows, comps = [], [], []
        bias = ring_bias(pos, cfg.attention_window, t)  # (B, 1, T, W), shared by the layers
        causal = chunk_bias(t, cfg.attention_window, hops.device)  # (T, T)
        for block, k, v in zip(net.blocks, ks, vs):
            x, k_row, v_row, c = block.step(x, k, v, pos, bias, causal)
            k_rows.append(k_row)
            v_rows.append(v_row)
            if c is not None:
                comps.append(c)
        net_gain = torch.sigmoid(net.head(x)).reshape(-1, t, f)  # (B, T, F): the network's gains
        out, activity, spec_next, ola_next, post = self.post(hops, min_gain, pos, spec, spec_delay, ola, post, net_gain)
        kv_rows = torch.cat(k_rows + v_rows, dim=2)  # (B, H, 2N*T, dh): keys of layers 0..N-1, then values
        head = [out]
        if self.with_comp:
            head.append(torch.stack(comps, dim=1).reshape(-1, t, len(comps), self.n_s))  # (B, T, n_tim, n_s)
        head += [activity, kv_rows]
        return tuple(head + [hops[:, -1], spec_next, *tails, ola_next, *post])

    def post(self, hops, min_gain, pos, spec, spec_delay, ola, post, net_gain):
        """From the network's gains (B, T, F) to the output: the rise limit, the exponent and the gain
        floor, the gains on the delayed spectrum, the pitch filter, the overlap-add. `spec` (B, T, 2F):
        the call's frames; `post`: the post-filters' state caches (`state_specs` order). Returns out
        (B, T, hop), activity (B, T), the new `spec_delay`, `ola` and post-filter states."""
        cfg, f, la, hop_n = self.config, self.f, self.config.lookahead, self.config.stft.hop
        n_limit = 2 if cfg.rise_limit_gain > 0 else 0
        limit_state, pitch_state = post[:n_limit], post[n_limit:]
        spec_all = torch.cat([spec_delay, spec], dim=1)  # (B, L+1+T, 2F): frame t's gain applies to row t+1
        applied = spec_all[:, 1:-la or None]  # (B, T, 2F): the rows the T gains apply to
        limited = net_gain
        if limit_state:  # the rise limit (`enhancer.build.model.postfilter`), carried across calls
            power = applied[..., :f] * applied[..., :f] + applied[..., f:] * applied[..., f:]
            limited, *limit_state = rise_limit(cfg, net_gain, power, *limit_state, first=pos - la, frames=self.frames)
        gain = torch.maximum(self.net.sharpen(limited), min_gain[:, None, None])  # those applied to the spectrum
        # the speech activity is read from the network's gains, whatever the post-filters
        plain = cfg.gain_exponent == 1.0 and not limit_state
        speech = gain if plain else torch.maximum(net_gain, min_gain[:, None, None])
        gain2 = torch.cat([gain, gain], dim=-1)  # on [re | im]
        frame = (applied * gain2) @ self.inv_basis  # (B, T, n_fft)
        if pitch_state:  # the pitch filter (`enhancer.build.model.pitchfilter`) on the frames the gains apply to
            frame, pitch_state = self._pitch_filter(hops, applied, gain, gain2, frame, *pitch_state)
        out = _overlap_add(frame, ola, hop_n)  # (B, T, hop)
        activity = speech[..., self.speech_bins[0]: self.speech_bins[1]].mean(dim=-1)  # (B, T)
        return out, activity, spec_all[:, -(la + 1):], frame[:, -1, hop_n:], [*limit_state, *pitch_state]

    def _pitch_filter(self, hops, applied, gain, gain2, plain, noisy_tail, plain_tail, plain_ola):
        """The frames (B, T, n_fft) after the pitch filter, and its new state. `plain`: the frames
        without it, whose overlap-add (tail `plain_ola`) is the output its pitch estimate reads."""
        t, hop_n = self.frames or hops.shape[1], self.config.stft.hop
        noisy = torch.cat([noisy_tail, hops.flatten(1)], dim=1)  # (B, S_x + T*hop)
        out = torch.cat([plain_tail, _overlap_add(plain, plain_ola, hop_n).flatten(1)], dim=1)  # (B, S_y + T*hop)
        filtered = pitchfilter.apply(self.config, applied, gain, pitchfilter.frames_at(noisy, t, hop_n),
                                     pitchfilter.frames_at(out, t, hop_n), _PitchConstants(self), frames=self.frames)
        frame = (filtered * gain2) @ self.inv_basis
        keep_x, keep_y = (dict(state_specs(self.config))[name][0] for name in ("pitch_x", "pitch_y"))  # (constants)
        state = [noisy[:, -keep_x:], out[:, -keep_y:], plain[:, -1, hop_n:]]
        return frame, state


def _overlap_add(frames: torch.Tensor, tail: torch.Tensor, hop: int) -> torch.Tensor:
    """frames (B, T, 2 hop), tail (B, hop): the T output hops (B, T, hop), each frame's first half
    added to the previous frame's second half (`tail` before the first frame)."""
    overlap = tail[:, None] if frames.shape[1] == 1 else torch.cat([tail[:, None], frames[:, :-1, hop:]], dim=1)
    return overlap + frames[..., :hop]


class _PitchConstants:
    """The step's buffers under the names `pitchfilter.apply` reads (traced as the graph's initializers)."""

    def __init__(self, step: StreamingStep):
        self.fwd = step.fwd_basis
        for name in pitchfilter.CONSTANTS:
            setattr(self, name, getattr(step, "pitch_" + name))
