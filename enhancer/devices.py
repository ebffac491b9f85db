"""Devices by name (CLI `--device`, the service's `device` setting) and the onnxruntime execution
providers each one asks for: the one map the command line, the runtime and the service share."""
from __future__ import annotations

# Providers in order of preference. None: CUDA when this onnxruntime has it, else CPU. "cuda" keeps
# the CPU provider behind CUDA for any node CUDA cannot run.
PROVIDERS: dict[str, tuple[str, ...] | None] = {
    "auto": None,
    "cpu": ("CPUExecutionProvider",),
    "cuda": ("CUDAExecutionProvider", "CPUExecutionProvider"),
}
DEVICES = tuple(PROVIDERS)


def providers_for(device: str) -> list[str] | None:
    """The providers of a device name (`PROVIDERS`); None for "auto"."""
    if device not in PROVIDERS:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    providers = PROVIDERS[device]
    return None if providers is None else list(providers)
