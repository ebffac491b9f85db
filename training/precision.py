"""The numeric precision of a training step: autocast (fp32, bf16, fp16) and tf32 on CUDA."""
from __future__ import annotations

from contextlib import nullcontext

import torch


def choose_precision(requested: str, device: torch.device) -> str:
    if requested == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "fp32"
    if requested not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be auto, fp32, bf16 or fp16, got {requested!r}")
    if requested == "fp16" and device.type != "cuda":
        raise ValueError("fp16 autocast needs CUDA; use bf16 or fp32 on CPU")
    return requested


def autocast_for(device: torch.device, precision: str):
    """The autocast context of a precision chosen by `choose_precision` (fp32: none)."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def allow_tf32(device: torch.device) -> None:
    """On CUDA, let the fp32 matrix products that autocast leaves use the tensor cores (tf32)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
