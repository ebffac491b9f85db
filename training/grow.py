"""`enhancer-train grow`: a wider or deeper model that starts from what a trained one computes, or
the same weights with another attention window.

    enhancer-train grow models/tim.pt --d-ffn 1024 -o runs/wide-init.pt
    enhancer-train grow models/tim.pt --blocks 9 -o runs/deep-init.pt
    enhancer-train grow models/tim.pt --d-model 608 -o runs/broad-init.pt
    enhancer-train grow models/tim.pt --conv-channels 1024,512,256,512 -o runs/conv-init.pt
    enhancer-train fit --init runs/wide-init.pt ...   # fine-tune the wider model
    enhancer-train grow models/tim.pt --attention-window 64 -o runs/w64-init.pt
    enhancer-train fit --init runs/w64-init.pt --teacher models/tim.pt --teacher-weight 20 ...

Each block's feed-forward layer gets more hidden units. The trained units are copied; the new ones
take random input weights (the initialisation of a fresh model) and zero output weights and biases,
so the grown model's output equals the trained one's (to float rounding) and training starts from
its quality rather than from scratch (Net2Net, Chen et al. 2016, with a zero-output variant of its
widening). With n mechanisms, each mechanism's feed-forward layer grows by the same share.

`--blocks N` inserts blocks after the last TIM block (for a model without mechanisms, before its
last ordinary blocks). Each new block copies the input side of the block before it (competition,
Q/K/V, inter-mechanism Q/K/V, feed-forward input) and starts with zero output projections, its
first norms plain (scale 1, shift 0) and its last norm the previous block's. With its sublayers
silent it computes g * normalize(x) + b on an x that is already g * z + b: the identity when the
previous norm's scale g is uniform, and close to it for trained weights (the shipped model's
output within 30-43 dB, as its norm scales lie within a few percent of their mean). Post-norm
blocks admit no exact identity, so unlike `--d-ffn` this is a warm start, not the same output.

`--d-model` multiplies the hidden size by a whole factor k, and the attention heads with it (each
keeps its width). Every unit of the residual stream is copied k times, inside its mechanism, and
every weight that reads the stream is divided by k (Net2WiderNet, Chen et al. 2016, with uniform
copies): a norm over k copies of a vector has that vector's mean and variance, a head copied k times
attends as the trained one, so the wider model computes exactly what the trained one computes. The
copies agree until training tells them apart: dropout gives each its own mask from the first step.

`--conv-channels` widens the pre-encoder's convolutions, each to a whole multiple of its width.
Every output channel of a widened convolution is copied (its filter, bias and norm scale and
shift), so its LayerNorm sees the same mean and variance and every copy the same activation; the
next convolution (or the projection into the stream) reads the copies of a channel with weights
that sum to the trained one's, split at random (Net2WiderNet, Chen et al. 2016). The output is the
trained model's; the unequal split gives the copies different gradients, so they part from the
first step.

`--attention-window` keeps every tensor and changes only how many past frames each frame attends to
(the mask in training, the key/value rings of the live step): a shorter window makes a cheaper live
step, whose output differs from the trained model's until it is fine-tuned (e.g. with the trained
model as `fit --teacher`).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from enhancer import load_checkpoint, save_checkpoint

from .data.manifests import DataError


def grow_checkpoint(path, out, d_ffn: int | None = None, seed: int = 0, attention_window: int | None = None,
                    blocks: int | None = None, d_model: int | None = None,
                    conv_channels: tuple[int, ...] | None = None) -> Path:
    """Write to `out` the checkpoint of `path` with feed-forward width `d_ffn` (>= the current one;
    None: the same), attention window `attention_window` (None: the same), `blocks` encoder
    blocks (>= the current number; None: the same), hidden size `d_model` (a whole multiple of
    the current one; None: the same) and pre-encoder widths `conv_channels` (one per convolution,
    each a whole multiple of the current one; None: the same)."""
    import torch

    from enhancer.build.model import build_model

    old = load_checkpoint(path)
    cfg = old.config
    d_ffn = cfg.d_ffn if d_ffn is None else d_ffn
    window = cfg.attention_window if attention_window is None else attention_window
    if window < 1:
        raise DataError(f"--attention-window {window}: must be at least 1 frame")
    if d_ffn < cfg.d_ffn:
        raise DataError(f"--d-ffn {d_ffn}: grow only widens (the checkpoint has {cfg.d_ffn})")
    if d_ffn % cfg.n_mechanisms:
        raise DataError(f"--d-ffn {d_ffn}: must be a multiple of the {cfg.n_mechanisms} mechanisms")
    n_layers = cfg.n_layers if blocks is None else blocks
    if n_layers < cfg.n_layers:
        raise DataError(f"--blocks {n_layers}: grow only adds blocks (the checkpoint has {cfg.n_layers})")
    at = cfg.n_layers - cfg.last_plain  # where new blocks go: after the last TIM block
    if n_layers > cfg.n_layers and (at < 1 or (cfg.n_mechanisms > 1 and not cfg.is_tim_layer(at - 1))):
        raise DataError(f"--blocks {n_layers}: the checkpoint has no block to copy before its last "
                        f"{cfg.last_plain} ordinary one(s)")
    d_model = cfg.d_model if d_model is None else d_model
    if d_model < cfg.d_model or d_model % cfg.d_model:
        raise DataError(f"--d-model {d_model}: must be a whole multiple of the checkpoint's {cfg.d_model} "
                        "(each unit is copied the same number of times)")
    factor = d_model // cfg.d_model
    channels = tuple(cfg.conv_channels) if conv_channels is None else tuple(int(c) for c in conv_channels)
    if len(channels) != len(cfg.conv_channels) or any(c < o or c % o for c, o in zip(channels, cfg.conv_channels)):
        raise DataError(f"--conv-channels {','.join(map(str, channels))}: needs {len(cfg.conv_channels)} widths, "
                        f"each a whole multiple of the checkpoint's "
                        f"({','.join(map(str, cfg.conv_channels))})")
    had_proj, has_proj = cfg.conv_channels[-1] != cfg.d_model, channels[-1] != d_model
    if not has_proj and (had_proj or channels[-1] != cfg.conv_channels[-1]):
        raise DataError(f"a last pre-encoder width of {channels[-1]}, the hidden size, would drop the projection "
                        "into the stream")
    new_cfg = dataclasses.replace(cfg, d_ffn=d_ffn, attention_window=window, n_layers=n_layers, d_model=d_model,
                                  n_heads=cfg.n_heads * factor, conv_channels=channels)
    with torch.random.fork_rng():  # the new units' seed, without touching the caller's random state
        torch.manual_seed(seed)
        new = build_model(new_cfg)
    own, src = new.state_dict(), old.state_dict()
    if has_proj and not had_proj:  # the pre-encoder wrote the stream itself: an identity projection, to widen
        eye = torch.eye(cfg.d_model, dtype=src["head.weight"].dtype)
        src = {**src, "proj.weight": eye, "proj.bias": torch.zeros(cfg.d_model, dtype=eye.dtype)}
    if n_layers > cfg.n_layers:  # new blocks first, at the trained width; then every block widens alike
        src = _insert_blocks(src, at, n_layers - cfg.n_layers)
    if factor > 1:  # then the stream widens: the same function, k copies of each unit
        src = _widen_stream(src, cfg, factor)
    if channels != tuple(cfg.conv_channels):  # the pre-encoder widens on its own: copies, split reads
        src = _widen_preencoder(src, tuple(cfg.conv_channels), channels, seed)
    state = {}
    for k, v in own.items():
        s = src[k]
        if s.shape == v.shape:
            state[k] = s
            continue
        # only the feed-forward tensors change: ffn_in.weight (G, dm, F/G) and .bias (G, F/G);
        # ffn_out.weight (G, F/G, dm). New hidden units: random in, zero bias, zero out.
        grown = v.clone() if k.endswith("ffn_in.weight") else torch.zeros_like(v)
        idx = tuple(slice(0, n) for n in s.shape)
        grown[idx] = s
        state[k] = grown
    new.load_state_dict(state)
    return save_checkpoint(new, new_cfg, out, grown_from={"path": str(path), "d_ffn": cfg.d_ffn, "seed": seed,
                                                           "attention_window": cfg.attention_window,
                                                           "blocks": cfg.n_layers, "d_model": cfg.d_model,
                                                           "conv_channels": list(cfg.conv_channels)})


_SILENT = ("out.", "inter_out.", "ffn_out.")  # a new block's output projections: zero
_PLAIN = ("norm_attn.", "norm_inter.")  # its first norms: scale 1, shift 0 (norm_ffn: the previous block's)


def _insert_blocks(state: dict, at: int, count: int) -> dict:
    """`state` with `count` blocks inserted at index `at`, each a silent copy of block `at - 1`."""
    out = {}
    for k, v in state.items():
        if not k.startswith("blocks."):
            out[k] = v
            continue
        _, i, rest = k.split(".", 2)
        i = int(i)
        out[f"blocks.{i if i < at else i + count}.{rest}"] = v
        if i == at - 1:
            if rest.startswith(_SILENT):
                v = v.new_zeros(v.shape)
            elif rest.startswith(_PLAIN):
                v = v.new_ones(v.shape) if rest.endswith("weight") else v.new_zeros(v.shape)
            for j in range(count):
                out[f"blocks.{at + j}.{rest}"] = v.clone()
    return out


# what each tensor of a block holds along its axes, after the group axis: "in" reads the stream
# (copied rows, divided by k), "out" writes it (copied columns), "heads3" holds queries, keys and
# values, head-major (each copied), "heads_in" reads the heads' read-out (copied rows, divided by
# k), "-" is left as it is (the competition score, the inter-mechanism and feed-forward hidden units)
_BLOCK_AXES = {
    "competition.weight": ("in", "-"), "competition.bias": ("-",),
    "qkv.weight": ("in", "heads3"), "qkv.bias": ("heads3",),
    "out.weight": ("heads_in", "out"), "out.bias": ("out",),
    "inter_qkv.weight": ("in", "-"), "inter_qkv.bias": ("-",),
    "inter_out.weight": ("-", "out"), "inter_out.bias": ("out",),
    "ffn_in.weight": ("in", "-"), "ffn_in.bias": ("-",),
    "ffn_out.weight": ("-", "out"), "ffn_out.bias": ("out",),
}


def _widen_stream(state: dict, cfg, k: int) -> dict:
    """`state` with the residual stream (and the attention heads) copied `k` times, the function kept.

    The stream of n mechanisms of width m becomes n mechanisms of width k*m, unit r of mechanism j
    holding old unit r mod m of j; a block's attention read-out of width m (heads x head width)
    likewise. A head copied k times attends as the old one, so only the weights that read the
    stream or a read-out are divided by k."""
    import torch

    def copies(parts: int, width: int):  # the index of `parts` runs of `width` units, each run copied k times
        n = torch.arange(parts * k * width)
        return (n // (k * width)) * width + n % (k * width) % width

    stream = copies(cfg.n_mechanisms, cfg.d_model // cfg.n_mechanisms)  # the whole stream, outside the blocks

    out = {}
    for key, v in state.items():
        if key.startswith("blocks."):
            rest = key.split(".", 2)[2]
            axes = ("out",) if rest.startswith("norm_") else _BLOCK_AXES[rest]  # a norm: (G, dm)
            dm = cfg.d_model // v.shape[0]  # this block's group width (and read-out width)
            # an ordinary block (one group) sees the whole stream; a TIM block one mechanism each
            units = stream if v.shape[0] == 1 else copies(1, dm)
            index = {"in": units, "out": units, "heads3": copies(3, dm), "heads_in": copies(1, dm)}
            for axis, kind in enumerate(axes, start=1):
                if kind != "-":  # heads3: (3 * dm) as (3, dm), q, k and v each copied
                    v = v.index_select(axis, index[kind])
                    if kind in ("in", "heads_in"):
                        v = v / k
            out[key] = v
        elif key.startswith("proj."):  # (d_model, c), (d_model,): writes the stream
            out[key] = v.index_select(0, stream)
        elif key == "head.weight":  # (F, d_model): reads it
            out[key] = v.index_select(1, stream) / k
        else:
            out[key] = v
    return out


def _widen_preencoder(state: dict, old: tuple[int, ...], new: tuple[int, ...], seed: int) -> dict:
    """`state` with pre-encoder convolution i's output channels copied new[i] / old[i] times, the
    function kept: the copies of a channel are read by what follows (the next convolution, or the
    projection into the stream) with weights split at random into parts that sum to the trained one."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = dict(state)
    for i, (o, n) in enumerate(zip(old, new)):
        if n == o:
            continue
        k = n // o
        index = torch.arange(n) % o  # channel c of the wide layer holds channel c mod o (copy c // o)
        part = torch.rand(k, o, generator=gen) + 0.5
        part = (part / part.sum(0)).reshape(-1)  # (n,): each channel's k parts sum to 1
        pre = f"pre.layers.{i}."
        for name in ("conv.weight", "conv.bias", "norm.weight", "norm.bias"):  # (c_out, ...): rows copied
            out[pre + name] = out[pre + name].index_select(0, index)
        if i + 1 < len(old):  # conv (c_out, c_in, K): reads the copies along axis 1
            key = f"pre.layers.{i + 1}.conv.weight"
            w = out[key].index_select(1, index)
            out[key] = w * part.to(w.dtype)[None, :, None]
        else:  # proj (d_model, c_out)
            w = out["proj.weight"].index_select(1, index)
            out["proj.weight"] = w * part.to(w.dtype)[None, :]
    return out


def _widths(text: str) -> tuple[int, ...]:
    """`--conv-channels 1024,512,256,512` -> (1024, 512, 256, 512)."""
    return tuple(int(c) for c in text.split(","))


_widths.__name__ = "comma-separated widths"  # argparse names the type in its error


def add_grow(sub) -> None:
    p = sub.add_parser("grow", help="widen a trained model (feed-forward layers, hidden size, pre-encoder) without changing its output, deepen it, "
                       "or change its attention window", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", metavar="CKPT", help="the trained model (.pt)")
    p.add_argument("--d-ffn", type=int, help="the new feed-forward width (all blocks)")
    p.add_argument("--attention-window", type=int, metavar="FRAMES",
                   help="frames each frame attends to (itself and FRAMES-1 past ones); the weights are kept")
    p.add_argument("--blocks", type=int, metavar="N",
                   help="the new number of encoder blocks (added after the last TIM block, near-silent)")
    p.add_argument("--d-model", type=int, metavar="D",
                   help="the new hidden size, a whole multiple of the current one (same output; heads multiply alike)")
    p.add_argument("--conv-channels", metavar="C0,C1,C2,C3", type=_widths,
                   help="the pre-encoder's new widths, each a whole multiple of the current one (same output)")
    p.add_argument("--seed", type=int, default=0, help="seed of the new units' input weights and of the split reads")
    p.add_argument("-o", "--out", required=True, help="the grown checkpoint (.pt)")

    def run(args) -> int:
        if (args.d_ffn is None and args.attention_window is None and args.blocks is None and args.d_model is None
                and args.conv_channels is None):
            p.error("give --d-ffn, --d-model, --conv-channels, --blocks, --attention-window or several")
        out = grow_checkpoint(args.checkpoint, args.out, args.d_ffn, seed=args.seed, attention_window=args.attention_window,
                              blocks=args.blocks, d_model=args.d_model, conv_channels=args.conv_channels)
        conv = None if args.conv_channels is None else ",".join(map(str, args.conv_channels))
        changes = [f"{name} {value}" for name, value in (("d_ffn", args.d_ffn), ("d_model", args.d_model),
                                                          ("conv channels", conv), ("blocks", args.blocks),
                                                          ("attention window", args.attention_window))
                   if value is not None]
        print(f"grew {args.checkpoint} to {', '.join(changes)}: {out}")
        return 0

    p.set_defaults(func=run)
