"""Checkpoints: config fields, STFT settings, normalisation statistics, versions and tensors.

Saved with `torch.save` but holding only plain containers and tensors, loaded with
`weights_only=True`: no pickled classes, so a checkpoint never executes code and survives refactors.
Writes are atomic (temporary file, then rename).
"""
from __future__ import annotations

import dataclasses
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

from ..config import ModelConfig
from ..errors import CheckpointError

FORMAT = "tim-enhancer-checkpoint/1"


def versions() -> dict[str, str]:
    import numpy
    import torch

    from ..version import __version__

    return {"enhancer": str(__version__), "torch": str(torch.__version__), "numpy": str(numpy.__version__),
            "python": platform.python_version()}


def save_checkpoint(model, config: ModelConfig, path, half: bool = False, **extra: Any) -> Path:
    """Atomically write `model`'s weights with `config`. `extra` (plain data or tensors) is kept
    under "extra" (training state, metrics...). `half` stores floating tensors as float16 (half the
    size; loading gives float32 again)."""
    import torch

    if model.config != config:
        raise CheckpointError("the model was built from a different config than the one given")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {
        "format": FORMAT,
        "config": config.to_dict(),
        "stft": config.to_dict()["stft"],
        "normalization": {"mean": model.feat_mean.detach().cpu().clone(), "std": model.feat_std.detach().cpu().clone()},
        "versions": versions(),
        "state_dict": {k: (v.detach().cpu().half() if half and v.is_floating_point() else v.detach().cpu())
                       for k, v in model.state_dict().items()},
        "extra": extra,
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(blob, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def read_checkpoint(path) -> dict[str, Any]:
    """The raw checkpoint dictionary, validated for format."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any unpickling failure means a corrupt or foreign file
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a tim-enhancer checkpoint (format {blob.get('format') if isinstance(blob, dict) else None!r})")
    return blob


def load_checkpoint(path, config: ModelConfig | None = None):
    """Load a checkpoint into a fresh `TIMNet` (eval mode). The model's `.config` is the stored
    config, `.checkpoint` the rest of the metadata. If `config` is given it must equal the stored one."""
    from .model import build_model

    blob = read_checkpoint(path)
    try:
        stored = ModelConfig.from_dict(blob["config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: invalid config in checkpoint: {e}") from None
    if config is not None and config != stored:
        diff = [f.name for f in dataclasses.fields(ModelConfig) if getattr(config, f.name) != getattr(stored, f.name)]
        raise CheckpointError(f"{path}: checkpoint config differs from the requested one in: {', '.join(diff)}")
    model = build_model(stored)
    state = blob["state_dict"]
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or wrong:
        parts = []
        if wrong:
            parts.append("shape mismatch: " + ", ".join(f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in wrong[:5]))
        if missing:
            parts.append(f"missing {len(missing)} tensors (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensors (e.g. {unexpected[0]})")
        raise CheckpointError(f"{path}: weights do not match the stored config {stored.name!r}: " + "; ".join(parts))
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    model.eval()
    model.checkpoint = {k: v for k, v in blob.items() if k != "state_dict"}
    return model
