"""The step graph's I/O specification (see `enhancer.build.model.step`): the names, order and shapes of
its inputs, outputs and per-stream caches, the decoder of its outputs (`StepOutputs`) and the one
writer of its key/value rings (`write_rings`).

Shared by the torch side (the step module, export, the parity check) and the runtime (numpy only).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import ModelConfig

# Version of the step graph's interface (input/output layout); stored in the model's metadata.
# 2: kv_rows is (B, H, 2N, dh).
# 3: a dynamic time axis, T frames per call: hops (B, T, hop), out (B, T, hop), competition
#    (B, T, n_tim, n_s), activity (B, T), kv_rows (B, H, 2N * T, dh) (that is (B, H, 2N, T, dh)
#    flattened); pos is the first frame's index.
STEP_FORMAT = "3"
RING_FORMATS = ("float32", "int8")  # how the key/value rings are stored: float, or 8-bit (`enhancer.build.ringquant`)

INPUTS = ("hops", "min_gain", "pos")  # then the caches (`cache_specs`)
NEXT = "_next"  # an updated state cache is output as its input's name + NEXT
PITCH_LAG_MAX = 320  # the pitch filter's longest lag, samples (`enhancer.build.model.pitchfilter.LAG_MAX`)


def state_specs(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Names and per-stream shapes (no batch dimension) of the state caches, in graph order."""
    dims = (cfg.n_freqs,) + tuple(cfg.conv_channels[:-1])
    specs = [("prev_hop", (cfg.stft.hop,)), ("spec_delay", (cfg.lookahead + 1, 2 * cfg.n_freqs))]
    specs += [(f"conv{i}", (cfg.kernel_size - 1, c)) for i, c in enumerate(dims)]
    specs.append(("ola", (cfg.stft.hop,)))
    if cfg.rise_limit_gain > 0:  # the rise limit's state (`enhancer.build.model.postfilter`)
        specs += [("prev_gain", (cfg.n_freqs,)), ("energy", (2,))]
    if cfg.pitch_filter > 0:  # the pitch filter's histories (`enhancer.build.model.pitchfilter`)
        history = PITCH_LAG_MAX + cfg.stft.n_fft
        specs += [("pitch_x", (history + (cfg.lookahead - 1) * cfg.stft.hop,)), ("pitch_y", (history - cfg.stft.hop,)),
                  ("pitch_ola", (cfg.stft.hop,))]
    return specs


def ring_specs(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Names and per-stream shapes of the key/value rings: k0..kN-1, then v0..vN-1, (H, W, dh) each."""
    kv = (cfg.n_heads, cfg.attention_window, cfg.head_dim)
    return [(f"k{j}", kv) for j in range(cfg.n_layers)] + [(f"v{j}", kv) for j in range(cfg.n_layers)]


def cache_specs(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """State caches then rings: every per-stream array of the step, in graph input order."""
    return state_specs(cfg) + ring_specs(cfg)


def has_competition(cfg: ModelConfig) -> bool:
    return cfg.competition and cfg.n_tim_layers > 0


def output_names(cfg: ModelConfig) -> list[str]:
    head = ["out"] + (["competition"] if has_competition(cfg) else []) + ["activity", "kv_rows"]
    return head + [n + NEXT for n, _ in state_specs(cfg)]


def input_names(cfg: ModelConfig) -> list[str]:
    return list(INPUTS) + [n for n, _ in cache_specs(cfg)]


def init_states(cfg: ModelConfig, batch: int = 1) -> list[np.ndarray]:
    """Zeroed state caches for `batch` streams (a fresh stream), in graph order."""
    return [np.zeros((batch,) + shape, dtype=np.float32) for _, shape in state_specs(cfg)]


def init_rings(cfg: ModelConfig, batch: int = 1, dtype=np.float32) -> np.ndarray:
    """Zeroed key/value rings for `batch` streams as one array (2N, B, H, W, dh): ring j is
    `rings[j]` (a contiguous view, graph input order), and one call's new rows are written with one
    assignment (`write_rings`). np.zeros: pages of lanes never used are never touched. int8 rings
    (`enhancer.build.ringquant`) hold each key ring transposed in the same memory (`ring_views`)."""
    specs = ring_specs(cfg)
    return np.zeros((len(specs), batch) + specs[0][1], dtype=dtype)


def ring_views(rings, keys_transposed: bool = False) -> list:
    """The graph inputs k0..kN-1, v0..vN-1 as views of `rings` (2N, B, H, W, dh); with
    `keys_transposed` (int8 rings) each key ring is seen as (B, H, dh, W)."""
    n = rings.shape[0] // 2
    if not keys_transposed:
        return list(rings)
    _, b, h, w, dh = rings.shape
    return [rings[j].reshape(b, h, dh, w) for j in range(n)] + list(rings[n:])


def init_caches(cfg: ModelConfig, batch: int = 1) -> list[np.ndarray]:
    """Every cache of `batch` fresh streams, in graph input order (states, then the rings' views)."""
    return init_states(cfg, batch) + list(init_rings(cfg, batch))


@dataclass(frozen=True)
class StepOutputs:
    """One call's outputs, by name (numpy arrays from onnxruntime, or tensors from the torch step)."""

    out: Any  # (B, T, hop) enhanced audio, delayed by the model's delay
    competition: Any | None  # (B, T, n_tim, n_s); None for models without competition
    activity: Any  # (B, T) mean gain over 300 Hz..4 kHz
    kv_rows: Any  # (B, H, 2N * T, dh): the new key/value rows, for `write_rings`
    states: list  # the updated state caches, in `state_specs` order

    @classmethod
    def decode(cls, cfg: ModelConfig, values: Sequence, names: Sequence[str] | None = None) -> StepOutputs:
        """The outputs of a call, given in the order of `names` (default: `output_names(cfg)`, the
        order of the graph and of the torch step's tuple), picked out by name."""
        names = output_names(cfg) if names is None else list(names)
        if len(names) != len(values):
            raise ValueError(f"{len(values)} step outputs for {len(names)} names")
        named = dict(zip(names, values))
        return cls(out=named["out"], competition=named.get("competition"), activity=named["activity"],
                   kv_rows=named["kv_rows"], states=[named[n + NEXT] for n, _ in state_specs(cfg)])


def write_rings(rings, kv_rows, pos, window: int, lanes=None, keys_transposed: bool = False) -> None:
    """Write the new key/value rows of one call (T frames) into slots (pos + t) % W, in place.

    rings: one array (2N, B, H, W, dh) holding k0..kN-1, v0..vN-1 (`init_rings`), numpy or torch,
    written with one assignment. kv_rows (k, H, 2N * T, dh) as the graph returns it ((k, H, 2N, T,
    dh) flattened: the rings' rows in the same order) and pos (k,) (the first frame's index) for the
    k streams at `lanes` of the rings (default: all B, in order). Of more than W frames only the
    last W are kept. `keys_transposed`: the key rings are stored as (B, H, dh, W) (`ring_views`)."""
    k, h, _, dh = kv_rows.shape
    kv_rows = kv_rows.reshape(k, h, rings.shape[0], -1, dh)  # (k, H, 2N, T, dh)
    t = kv_rows.shape[3]
    if t > window:
        kv_rows, pos, t = kv_rows[:, :, :, t - window:], pos + (t - window), window
    if isinstance(pos, np.ndarray):
        offsets = np.arange(t)
        lanes = np.arange(pos.shape[0]) if lanes is None else np.asarray(lanes)
        rows = kv_rows.transpose(0, 3, 2, 1, 4)  # (k, T, 2N, H, dh)
    else:  # a torch tensor (the build's parity checks): indices made alike, without importing torch here
        offsets = pos.new_tensor(np.arange(t))
        lanes = pos.new_tensor(np.arange(pos.shape[0]) if lanes is None else np.asarray(lanes))
        rows = kv_rows.permute(0, 3, 2, 1, 4)
    slots = (pos[:, None] + offsets[None, :]) % window  # (k, T)
    if not keys_transposed:
        rings[:, lanes[:, None], :, slots] = rows  # indexed as (k, T, 2N, H, dh)
        return
    n, (_, b, h, w, dh) = rings.shape[0] // 2, rings.shape
    keys = rings[:n].reshape(n, b, h, dh, w)  # a view
    keys[:, lanes[:, None], :, :, slots] = rows[:, :, :n]  # indexed as (k, T, N, H, dh)
    rings[n:, lanes[:, None], :, slots] = rows[:, :, n:]


def lane_shapes(engine, k: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of each array of a pool's `export_lanes` for k lanes of `engine`'s pools
    (`enhancer.pools`): `pos`, the states (float32), the rings (float32, or int8 with each key ring
    as (k, H, dh, W))."""
    cfg = engine.config
    out = {"pos": ((k,), np.dtype(np.int64))}
    out.update({name: ((k,) + shape, np.dtype(np.float32)) for name, shape in state_specs(cfg)})
    ring = np.dtype(np.int8 if engine.int8_rings else np.float32)
    for name, (h, w, dh) in ring_specs(cfg):
        out[name] = ((k, h, dh, w) if engine.int8_rings and name.startswith("k") else (k, h, w, dh), ring)
    return out


def lane_state_bytes(engine, k: int) -> int:
    """Bytes of the arrays of `lane_shapes(engine, k)`: the state of k lanes."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in lane_shapes(engine, k).values())


def check_lane_arrays(engine, k: int, arrays: dict) -> dict[str, np.ndarray]:
    """`arrays` checked against `lane_shapes(engine, k)` (ValueError on any difference), as arrays."""
    want = lane_shapes(engine, k)
    if set(arrays) != set(want):
        raise ValueError(f"lane state has arrays {sorted(arrays)}, expected {sorted(want)}")
    out = {}
    for name, (shape, dtype) in want.items():
        a = np.asarray(arrays[name])
        if a.shape != shape or a.dtype != dtype:
            raise ValueError(f"lane state {name!r} is {a.dtype}{list(a.shape)}, expected {dtype}{list(shape)}")
        out[name] = a
    return out
