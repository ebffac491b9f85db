"""Layout of the step graph's inputs, outputs and per-stream caches (see `enhancer.model.step`).

Shared by the torch side (export, reference) and the runtime (numpy only)."""
from __future__ import annotations

import numpy as np

from .config import ModelConfig

# Version of the step graph's interface (input/output layout); stored in the model's metadata.
# 2: kv_rows is (B, H, 2N, dh).
STEP_FORMAT = "2"


def state_specs(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Names and per-stream shapes (no batch dimension) of the state caches, in graph order."""
    dims = (cfg.n_freqs,) + tuple(cfg.conv_channels[:-1])
    specs = [("prev_hop", (cfg.stft.hop,)), ("spec_delay", (cfg.lookahead + 1, 2 * cfg.n_freqs))]
    specs += [(f"conv{i}", (cfg.kernel_size - 1, c)) for i, c in enumerate(dims)]
    return specs + [("ola", (cfg.stft.hop,))]


def ring_specs(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    kv = (cfg.n_heads, cfg.window, cfg.head_dim)
    return [(f"k{j}", kv) for j in range(cfg.n_layers)] + [(f"v{j}", kv) for j in range(cfg.n_layers)]


def cache_specs(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """State caches then rings: every per-stream array of the step, in graph input order."""
    return state_specs(cfg) + ring_specs(cfg)


def has_competition(cfg: ModelConfig) -> bool:
    return cfg.competition and cfg.n_tim_layers > 0


def output_names(cfg: ModelConfig) -> list[str]:
    head = ["out"] + (["competition"] if has_competition(cfg) else []) + ["activity", "kv_rows"]
    return head + [f"{n}_next" for n, _ in state_specs(cfg)]


def input_names(cfg: ModelConfig) -> list[str]:
    return ["hop", "min_gain", "pos"] + [n for n, _ in cache_specs(cfg)]


def init_caches(cfg: ModelConfig, batch: int = 1) -> list[np.ndarray]:
    return [np.zeros((batch,) + shape, dtype=np.float32) for _, shape in cache_specs(cfg)]


def write_rings(rings, kv_rows, pos, window: int, batch=None) -> None:
    """Write new key/value rows into slot pos % W of the rings, in place.

    rings: k0..kN-1, v0..vN-1, each (B, H, W, dh), numpy or torch; kv_rows (k, H, 2N, dh) (the
    rings' rows in the same order) and pos (k,) for the k streams at indices `batch` of the rings
    (default: all B, in order)."""
    slot = pos % window
    batch = np.arange(slot.shape[0]) if batch is None else batch
    for j, ring in enumerate(rings):
        ring[batch, :, slot] = kv_rows[:, :, j]  # (k, H, dh)
