"""`enhancer-train grow`: a wider model that computes exactly what a trained one computes.

    enhancer-train grow models/tim.pt --d-ffn 1024 -o runs/wide-init.pt
    enhancer-train fit --init runs/wide-init.pt ...   # fine-tune the wider model

Each block's feed-forward layer gets more hidden units. The trained units are copied; the new ones
take random input weights (the initialisation of a fresh model) and zero output weights and biases,
so the grown model's output equals the trained one's (to float rounding) and training starts from
its quality rather than from scratch (Net2Net, Chen et al. 2016, with a zero-output variant of its
widening). With n mechanisms, each mechanism's feed-forward layer grows by the same share.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from enhancer import load_checkpoint, save_checkpoint

from .data.manifests import DataError


def grow_checkpoint(path, out, d_ffn: int, seed: int = 0) -> Path:
    """Write to `out` the checkpoint of `path` with feed-forward width `d_ffn` (>= the current one)."""
    import torch

    from enhancer.model import build_model

    old = load_checkpoint(path)
    cfg = old.config
    if d_ffn < cfg.d_ffn:
        raise DataError(f"--d-ffn {d_ffn}: grow only widens (the checkpoint has {cfg.d_ffn})")
    if d_ffn % cfg.n_mechanisms:
        raise DataError(f"--d-ffn {d_ffn}: must be a multiple of the {cfg.n_mechanisms} mechanisms")
    new_cfg = dataclasses.replace(cfg, d_ffn=d_ffn)
    with torch.random.fork_rng():  # the new units' seed, without touching the caller's random state
        torch.manual_seed(seed)
        new = build_model(new_cfg)
    own, src = new.state_dict(), old.state_dict()
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
    return save_checkpoint(new, new_cfg, out, grown_from={"path": str(path), "d_ffn": cfg.d_ffn, "seed": seed})


def add_grow(sub) -> None:
    p = sub.add_parser("grow", help="widen a trained model's feed-forward layers without changing its output",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", metavar="CKPT", help="the trained model (.pt)")
    p.add_argument("--d-ffn", type=int, required=True, help="the new feed-forward width (all blocks)")
    p.add_argument("--seed", type=int, default=0, help="seed of the new units' input weights")
    p.add_argument("-o", "--out", required=True, help="the grown checkpoint (.pt)")

    def run(args) -> int:
        out = grow_checkpoint(args.checkpoint, args.out, args.d_ffn, seed=args.seed)
        print(f"grew {args.checkpoint} to d_ffn {args.d_ffn}: {out}")
        return 0

    p.set_defaults(func=run)
