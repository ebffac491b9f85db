"""Torch model (training, export, reference). Imported only where torch is wanted."""
from ...step_io import cache_specs, init_caches, write_rings
from .net import TIMNet, count_parameters
from .step import StreamingStep

__all__ = ["StreamingStep", "TIMNet", "build_model", "cache_specs", "count_parameters", "init_caches", "write_rings"]


def build_model(config) -> TIMNet:
    """Build the torch module for a `ModelConfig` (or a preset name)."""
    from ...config import ModelConfig

    if isinstance(config, str):
        config = ModelConfig.preset(config)
    return TIMNet(config)
