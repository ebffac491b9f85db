"""Layout of the step graph's inputs, outputs and per-stream caches (see `enhancer.model.step`).

Shared by the torch side (export, reference) and the runtime (numpy only)."""
from __future__ import annotations

import numpy as np

from .config import ModelConfig

# Version of the step graph's interface (input/output layout); stored in the model's metadata.
# 2: kv_rows is (B, H, 2N, dh).
# 3: a dynamic time axis, T frames per call: hops (B, T, hop), out (B, T, hop), competition
#    (B, T, n_tim, n_s), activity (B, T), kv_rows (B, H, 2N * T, dh) (that is (B, H, 2N, T, dh)
#    flattened); pos is the first frame's index.
STEP_FORMAT = "3"


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
    return ["hops", "min_gain", "pos"] + [n for n, _ in cache_specs(cfg)]


def init_caches(cfg: ModelConfig, batch: int = 1) -> list[np.ndarray]:
    return [np.zeros((batch,) + shape, dtype=np.float32) for _, shape in cache_specs(cfg)]


def write_rings(rings, kv_rows, pos, window: int, batch=None) -> None:
    """Write the new key/value rows of one call (T frames) into slots (pos + t) % W, in place.

    rings: k0..kN-1, v0..vN-1, each (B, H, W, dh), or one array (2N, B, H, W, dh) holding them all
    (written with one assignment); numpy or torch. kv_rows (k, H, 2N * T, dh) as the graph returns
    it ((k, H, 2N, T, dh) flattened: the rings' rows in the same order) and pos (k,) (the first
    frame's index) for the k streams at indices `batch` of the rings (default: all B, in order).
    Of more than W frames only the last W are kept."""
    k, h, _, dh = kv_rows.shape
    kv_rows = kv_rows.reshape(k, h, len(rings), -1, dh)  # (k, H, 2N, T, dh)
    t = kv_rows.shape[3]
    if t > window:
        kv_rows, pos, t = kv_rows[:, :, :, t - window:], pos + (t - window), window
    if isinstance(pos, np.ndarray):
        offsets = np.arange(t)
        batch = np.arange(pos.shape[0]) if batch is None else np.asarray(batch)
    else:
        import torch

        offsets = torch.arange(t)
        batch = torch.arange(pos.shape[0]) if batch is None else torch.as_tensor(batch)
    slots = (pos[:, None] + offsets[None, :]) % window  # (k, T)
    lanes = batch[:, None]  # (k, 1)
    if not isinstance(rings, (list, tuple)):  # (2N, B, H, W, dh): indexed as (k, T, 2N, H, dh)
        rings[:, lanes, :, slots] = kv_rows.transpose(0, 3, 2, 1, 4) if isinstance(kv_rows, np.ndarray) \
            else kv_rows.permute(0, 3, 2, 1, 4)
        return
    for j, ring in enumerate(rings):
        ring[lanes, :, slots] = kv_rows[:, :, j].swapaxes(1, 2)  # (k, T, H, dh)
