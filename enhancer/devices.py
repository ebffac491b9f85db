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
# The [gpu] extra's onnxruntime-gpu and the CUDA major version its CUDA provider is built for (its
# libraries' sonames end in it: `enhancer.engine.CUDA_LIBRARIES`). Changing the pin means checking
# the new wheel's CUDA and updating both, the nvidia-* pins and the image (tests/test_gpu_pins.py).
GPU_RUNTIME = {"onnxruntime-gpu": "1.31.1", "cuda_major": 13}


def providers_for(device: str) -> list[str] | None:
    """The providers of a device name (`PROVIDERS`); None for "auto"."""
    if device not in PROVIDERS:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    providers = PROVIDERS[device]
    return None if providers is None else list(providers)


def available_providers() -> list[str]:
    """The execution providers this onnxruntime build offers."""
    import onnxruntime as ort

    return list(ort.get_available_providers())


def check_device(device: str, used: str | None = None) -> None:
    """`DeviceError` when `device` cannot be honoured here instead of a silent fall-back to the CPU:
    "cuda" with an onnxruntime without CUDAExecutionProvider, or (`used`: the provider a loaded
    session really runs on) a CUDA provider that failed to start. The command line and the service
    refuse with this same message."""
    from .errors import DeviceError

    providers_for(device)  # a known name
    if device != "cuda":
        return
    if "CUDAExecutionProvider" not in available_providers():
        raise DeviceError("device 'cuda' requested but onnxruntime has no CUDAExecutionProvider "
                          "(install the [gpu] extra on a machine with CUDA)")
    if used is not None and used != "CUDAExecutionProvider":
        raise DeviceError(f"device 'cuda' requested but the model runs on {used}: onnxruntime could not start "
                          "CUDA here (driver, libraries or GPU missing); use --device cpu or auto")
