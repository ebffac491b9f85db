"""tim-enhancer: real-time speech enhancement with a causal Transformer with Independent Mechanisms.

Inference (`Enhancer`, `StreamingEnhancer`) needs numpy, onnxruntime and soundfile only;
`build_model`, `save_checkpoint` and `load_checkpoint` import torch when called.
"""
from .config import ModelConfig, STFTConfig
from .errors import AudioDecodeError, AudioError, CheckpointError, EnhancerError
from .version import __version__

__all__ = [
    "AudioDecodeError",
    "AudioError",
    "CheckpointError",
    "Enhancer",
    "EnhancerError",
    "ModelConfig",
    "STFTConfig",
    "StreamingEnhancer",
    "__version__",
    "build_model",
    "load_checkpoint",
    "save_checkpoint",
]


def build_model(config):
    """Torch module for a `ModelConfig` or preset name (imports torch)."""
    from .build.model import build_model as _build

    return _build(config)


def save_checkpoint(model, config, path, **extra):
    from .build.checkpoint import save_checkpoint as _save

    return _save(model, config, path, **extra)


def load_checkpoint(path, config=None):
    from .build.checkpoint import load_checkpoint as _load

    return _load(path, config)


def __getattr__(name):
    if name in ("Enhancer", "StreamingEnhancer"):
        from . import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'enhancer' has no attribute {name!r}")
