"""The CUDA side of the [gpu] extra stays in step: onnxruntime-gpu's pin, the CUDA major version its
provider is built for (`enhancer.devices.GPU_RUNTIME`), the nvidia-* library wheels that supply that
CUDA, the sonames the runtime preloads, and the GPU image (which must not bring a CUDA of its own)."""
from __future__ import annotations

import re
from pathlib import Path

import tomllib

from enhancer.devices import GPU_RUNTIME
from enhancer.engine import CUDA_LIBRARIES

ROOT = Path(__file__).resolve().parents[1]


def _gpu_pins() -> dict[str, str]:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    pins = {}
    for req in extra:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[a-z,]+\])?==([0-9][0-9A-Za-z.]*)", req)
        assert m, f"[gpu] requirement {req!r} is not pinned with =="
        pins[m.group(1).lower()] = m.group(3)
    return pins


def test_onnxruntime_gpu_pin_is_the_one_checked():
    assert _gpu_pins()["onnxruntime-gpu"] == GPU_RUNTIME["onnxruntime-gpu"]


def test_cuda_wheels_match_the_providers_cuda():
    """CUDA 13 libraries for a CUDA 13 build: runtime, cuBLAS and NVRTC carry the CUDA major as their
    own; cuDNN names it in the package (-cuNN); cuRAND (10) and cuFFT (12) keep their own numbering
    (the sonames the provider links: libcurand.so.10, libcufft.so.12 in CUDA 13)."""
    major = GPU_RUNTIME["cuda_major"]
    pins = _gpu_pins()
    for name in ("nvidia-cuda-runtime", "nvidia-cublas", "nvidia-cuda-nvrtc"):
        assert pins[name].split(".")[0] == str(major), (name, pins[name], major)
    assert f"nvidia-cudnn-cu{major}" in pins
    assert not [n for n in pins if re.fullmatch(r"nvidia-.*-cu\d+", n) and not n.endswith(f"-cu{major}")]
    assert pins["nvidia-curand"].startswith("10.") and pins["nvidia-cufft"].startswith("12.")


def test_preloaded_sonames_are_that_cuda():
    major = GPU_RUNTIME["cuda_major"]
    for lib in ("libcudart", "libcublasLt", "libcublas"):
        assert f"{lib}.so.{major}" in CUDA_LIBRARIES


def test_gpu_image_brings_no_cuda_of_its_own():
    """The gpu stage builds on the same Python image as the CPU one (the libraries come from the
    wheels above); a CUDA base image would add a second CUDA whose libraries the provider may load."""
    text = (ROOT / "Dockerfile").read_text()
    stages = {alias: image for image, alias in re.findall(r"^FROM\s+(\S+)\s+AS\s+(\S+)", text, re.M)}
    assert stages["base-gpu"] == stages["base-cpu"] == "${PYTHON_IMAGE}"
    assert not re.search(r"nvidia/cuda|cudnn-runtime|cuda-runtime", text, re.I)
    assert 'pip install --no-cache-dir ".[${DEVICE},serve]"' in text  # DEVICE=gpu installs the [gpu] extra
