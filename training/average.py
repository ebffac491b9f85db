"""`enhancer-train average`: one checkpoint whose weights are the (weighted) mean of several.

    enhancer-train average runs/a/checkpoints/step-00000900.pt runs/b/checkpoints/step-00000900.pt \\
                           -o runs/ab.pt
    enhancer export runs/ab.pt -o ab.onnx --fp16

Averaging the weights of runs fine-tuned from the same starting point (a "model soup", Wortsman et
al. 2022; checkpoint averaging as in fairseq) often scores above each of them, at no cost at run
time: the result is a regular checkpoint of the same architecture. The inputs must share the model
config, the STFT settings and the feature normalisation (they do when they come from one `--init`);
anything else is refused, since averaging unrelated weights gives noise. Tensors are summed in
float64; integer buffers are taken from the first input and must be equal in all.
"""
from __future__ import annotations

from pathlib import Path

from enhancer import load_checkpoint, save_checkpoint

from .data.manifests import DataError


def average_checkpoints(paths, out, weights=None, half: bool = False) -> Path:
    """Write to `out` the checkpoint whose floating tensors are the weighted mean of those in
    `paths` (`weights`: one non-negative number per input, normalised to sum 1; default equal)."""
    import torch

    paths = [Path(p) for p in paths]
    if len(paths) < 2:
        raise DataError("average needs at least two checkpoints")
    if weights is None:
        weights = [1.0] * len(paths)
    if len(weights) != len(paths):
        raise DataError(f"{len(weights)} weight(s) for {len(paths)} checkpoint(s)")
    if any(not (w >= 0) for w in weights) or sum(weights) <= 0:
        raise DataError(f"weights must be non-negative with a positive sum, got {weights}")
    total = float(sum(weights))
    weights = [float(w) / total for w in weights]

    first = load_checkpoint(paths[0])
    ref = first.state_dict()
    acc = {k: v.double() * weights[0] if v.is_floating_point() else v.clone() for k, v in ref.items()}
    for path, w in zip(paths[1:], weights[1:]):
        model = load_checkpoint(path)
        if model.config != first.config:
            raise DataError(f"{path}: model config differs from {paths[0]}'s; only runs of one architecture average")
        state = model.state_dict()
        for k in ("feat_mean", "feat_std"):
            if not torch.equal(state[k], ref[k]):
                raise DataError(f"{path}: feature normalisation ({k}) differs from {paths[0]}'s; "
                                "average only runs that started from the same --init")
        for k, v in state.items():
            if v.is_floating_point():
                acc[k] += v.double() * w
            elif not torch.equal(v, ref[k]):
                raise DataError(f"{path}: buffer {k} differs from {paths[0]}'s")
    first.load_state_dict({k: v.to(ref[k].dtype) for k, v in acc.items()})
    sources = [{"path": str(p), "weight": w} for p, w in zip(paths, weights)]
    return save_checkpoint(first, first.config, out, half=half, averaged=sources)


def add_average(sub) -> None:
    p = sub.add_parser("average", help="average the weights of checkpoints of one architecture (a model soup)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="+", metavar="CKPT", help="two or more checkpoints (.pt)")
    p.add_argument("-o", "--out", required=True, help="the averaged checkpoint (.pt)")
    p.add_argument("--weights", type=float, nargs="+", metavar="W",
                   help="one weight per checkpoint (default: equal)")
    p.add_argument("--half", action="store_true", help="store the weights as float16")

    def run(args) -> int:
        out = average_checkpoints(args.checkpoints, args.out, weights=args.weights, half=args.half)
        print(f"averaged {len(args.checkpoints)} checkpoints into {out}")
        return 0

    p.set_defaults(func=run)
