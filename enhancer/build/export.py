"""Export the streaming step graph to ONNX, check it, and compare onnxruntime against torch.

The ONNX file is self-contained: weights, DFT bases, normalisation statistics, and metadata
(`tim_enhancer.config` JSON, cache layout, delay) that the runtime reads. No side files.
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np

from ..config import ModelConfig

OPSET = 17
META_PREFIX = "tim_enhancer."
# Export check of a float graph: onnxruntime's output may differ from torch's by at most this
# fraction of the output's peak (float32 rounding in a different order of operations; a real
# mismatch, e.g. a ring written in the wrong slot, is orders of magnitude above it).
MAX_REL_DIFF = 1e-4


def export_step(model, path, check: bool = True, batch: int = 2, n_check_steps: int = 0, verbose: bool = False,
                fp16_weights: bool = False, int8_weights: bool = False, ring_calibration=None) -> dict:
    """Write `model`'s step graph to `path`. Returns a report with the max abs difference between
    onnxruntime and torch over `n_check_steps` frames of random audio (default: 3 x window + 8), run
    in calls of 1 to W + 5 frames (`check_chunks`) with the lanes at different positions, that
    difference relative to the output's peak (`max_rel_diff`, gated by `MAX_REL_DIFF`) and the
    signal-to-difference ratio of the output audio (`parity_snr_db`). `verbose`: say each stage on
    stderr, with a progress bar for the comparison.

    `int8_weights` computes the dense layers in 8 bits (`enhancer.build.quantize`): a quarter of the
    weight bytes to read per step and onnxruntime's 8-bit products, so a faster step, but no longer
    exact: the check then reports how far the output is from torch instead of bit-level parity.

    `fp16_weights` stores the large weight tensors as float16 (half the file size); onnxruntime
    casts them back to float32 once when it loads the graph, so the speed is unchanged. The weights
    must already be float16 values (`round_to_fp16(model)`), so that the file is exact.

    `ring_calibration` (16 kHz mono float32 signals) stores the key/value rings as int8, with
    per-(ring, head) scales calibrated on those signals (`enhancer.build.ringquant`): a quarter of the
    bytes per stream and the live step's ring products in 8-bit arithmetic; not bit-exact either,
    so the check reports `parity_snr_db`. A path instead of signals takes the scales of that
    earlier export (`ringquant.graph_ring_scales`): the same 8-bit rings again."""
    import onnx

    from .graph_switch import join_live_branch
    from .model import StreamingStep, count_parameters
    from ..step_io import STEP_FORMAT, input_names, output_names
    from ..version import __version__

    def _say(msg: str) -> None:
        if verbose:
            print(msg, file=sys.stderr, flush=True)

    cfg: ModelConfig = model.config
    step = StreamingStep(model).eval()
    names_in, names_out = input_names(cfg), output_names(cfg)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _say(f"tracing the step graph of preset {cfg.name} ({count_parameters(model):,} parameters) to {path}, "
         "live (T = 1) and any T")
    general, live = _trace(step, batch, frames=None), _trace(step, batch, frames=1)
    if int8_weights:
        from .quantize import quantize_int8

        _say("quantizing the dense layers to 8 bits")
        general, live = quantize_int8(general), quantize_int8(live)
    proto = join_live_branch(general, live)
    weights = "int8" if int8_weights else "fp16" if fp16_weights else "fp32"
    meta = {
        "config": json.dumps(cfg.to_dict()),
        "version": __version__,
        "step_format": STEP_FORMAT,
        "parameters": str(count_parameters(model)),
        "delay_samples": str(cfg.delay_samples),
        "latency_ms": str(cfg.algorithmic_latency_ms),
        "frames_per_call": "dynamic",  # T of hops (B, T, hop): 1 for live steps, any T for offline chunks
        "inputs": json.dumps(names_in),
        "outputs": json.dumps(names_out),
        "weights": weights,
    }
    _set_metadata(proto, meta)
    if ring_calibration is not None:
        proto, meta["rings"] = _int8_rings(proto, ring_calibration, path, _say), "int8"
        _set_metadata(proto, meta)
    if fp16_weights:
        _say("storing the weights as float16")
        _store_fp16(proto)
    proto.producer_name = "tim-enhancer"
    proto.doc_string = f"tim-enhancer streaming step graph, preset {cfg.name}"
    onnx.save(proto, str(path))
    report = {"path": str(path), "parameters": count_parameters(model), "bytes": path.stat().st_size}
    if check:
        _say("checking the graph (onnx.checker, full check)")
        onnx.checker.check_model(str(path), full_check=True)
        n = n_check_steps or 3 * cfg.attention_window + 8
        _say(f"comparing onnxruntime with torch over {n} frames of random audio, in calls of 1 to {cfg.attention_window + 5} "
             "frames, lanes at different positions")
        parity = compare_with_torch(step, path, batch, n, progress=verbose)
        report.update({k: parity[k] for k in ("max_abs_diff", "max_rel_diff", "parity_snr_db")})
        _say(f"onnxruntime vs torch over {n} frames: max abs diff {report['max_abs_diff']:.3g} "
             f"({report['max_rel_diff']:.3g} of the output's peak), output / difference {report['parity_snr_db']:.1f} dB")
    report["weights"] = weights
    report["rings"] = meta.get("rings", "float32")
    return report


def _set_metadata(proto, meta: dict) -> None:
    keys = {META_PREFIX + k for k in meta}
    kept = [e for e in proto.metadata_props if e.key not in keys]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    for k, v in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = META_PREFIX + k, v


def _int8_rings(proto, signals, path: Path, say):
    """`proto` (joined, float rings, metadata set) with int8 rings calibrated on `signals`."""
    import tempfile

    import onnx

    from ..engine import Engine
    from .ringquant import HEADROOM, calibrate_rings, graph_ring_scales, quantize_rings, ring_scales

    if isinstance(signals, (str, Path)):  # the scales of an earlier export
        scales, seconds = graph_ring_scales(signals)
        say(f"the 8-bit key/value rings of {signals} (calibrated on {seconds} s of audio)")
        q = quantize_rings(proto, scales)
        _set_metadata(q, {"ring_calibration_seconds": seconds})
        return q
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        f = Path(tmp) / "float_rings.onnx"
        onnx.save(proto, str(f))
        say("calibrating the 8-bit key/value rings")
        amax, seconds = calibrate_rings(Engine(f), signals)
    say(f"calibrated on {seconds:.1f} s of audio: largest key/value magnitude {amax.max():.3g}, "
        f"scales = {HEADROOM:g} x that per ring and head / 127")
    q = quantize_rings(proto, ring_scales(amax))
    _set_metadata(q, {"ring_calibration_seconds": f"{seconds:.1f}"})
    return q


def _trace(step, batch: int, frames: int | None):
    """The ONNX proto of torch step `step` traced with `batch` lanes: T = `frames` fixed, or (None)
    a dynamic T (traced with T = 3, so that no axis of size 1 is taken for a constant)."""
    import io

    import onnx
    import torch

    from ..step_io import init_caches, input_names, output_names

    cfg = step.config
    names_in, names_out = input_names(cfg), output_names(cfg)
    caches = [torch.from_numpy(c) for c in init_caches(cfg, batch)]
    t = frames or 3
    args = (torch.zeros(batch, t, cfg.stft.hop), torch.zeros(batch), torch.zeros(batch, dtype=torch.long), *caches)
    axes = {n: {0: "batch"} for n in names_in + names_out}
    if frames is None:
        for n in ("hops", "out", "competition", "activity"):
            axes[n] = {0: "batch", 1: "frames"}
        axes["kv_rows"] = {0: "batch", 2: "rows"}
    buf = io.BytesIO()
    step.frames = frames  # a fixed T: the step's shapes at that T are constants of the graph
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                step, args, buf, dynamo=False, opset_version=OPSET, input_names=names_in, output_names=names_out,
                dynamic_axes={n: a for n, a in axes.items() if n in names_in + names_out}, do_constant_folding=True,
            )
    finally:
        step.frames = None
    return onnx.load_from_string(buf.getvalue())


CHECK_CHUNKS = (1, 3, 1, 64, 2, 1, 31, 1)  # frames per call of the parity check, cycled, then one of W + 5


def check_chunks(window: int, n_frames: int) -> list[int]:
    """Frames per call covering `n_frames`: single steps, small and large chunks (`CHECK_CHUNKS`,
    cycled), and once the rings have wrapped one chunk longer than the attention window."""
    sizes, long_done = [], False
    while (total := sum(sizes)) < n_frames:
        if total >= window and not long_done:
            t, long_done = window + 5, True
        else:
            t = CHECK_CHUNKS[len(sizes) % len(CHECK_CHUNKS)]
        sizes.append(min(t, n_frames - total))
    return sizes


def split_at(sizes: list[int], points) -> list[int]:
    """`sizes` (frames per call) with calls split so that a call begins at each of `points`."""
    cuts = sorted({int(p) for p in points if 0 < p < sum(sizes)})
    out, begin = [], 0
    for t in sizes:
        end = begin + t
        for c in [c for c in cuts if begin < c < end]:
            out.append(c - begin)
            begin = c
        out.append(end - begin)
        begin = end
    return out


def compare_with_torch(step, path, batch: int, n_steps: int, seed: int = 0, stagger: int | None = None,
                       progress: bool = False) -> dict:
    """Run the same random audio through torch and onnxruntime in calls of `check_chunks` frames,
    with the batch's lanes at different positions: lane b (re)starts (caches cleared, pos 0, as when
    a stream joins a running batch) at frame b * `stagger`
    (default: a third of the attention window, plus one; calls are split there), so calls cover lanes whose rings have
    wrapped around next to lanes that are still filling.

    Returns `max_abs_diff` (output audio), `max_rel_diff` (that over the peak of torch's output: the
    figure to gate on, since it does not depend on the signal's level), `parity_snr_db` (energy of
    torch's output over the energy of the difference, inf when identical) and `positions` (each
    lane's position after the last call)."""
    import onnxruntime as ort
    import torch
    from tqdm import tqdm

    from ..step_io import StepOutputs, init_rings, init_states, ring_views, write_rings

    cfg = step.config
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    onnx_out = [o.name for o in sess.get_outputs()]
    int8 = next(i for i in sess.get_inputs() if i.name == "k0").type == "tensor(int8)"  # enhancer.build.ringquant
    rng = np.random.default_rng(seed)
    stagger = cfg.attention_window // 3 + 1 if stagger is None else stagger
    start = np.arange(batch) * stagger  # the step at which each lane (re)starts
    np_states, np_rings = init_states(cfg, batch), init_rings(cfg, batch, np.int8 if int8 else np.float32)
    t_states, t_rings = [torch.from_numpy(c.copy()) for c in np_states], torch.from_numpy(init_rings(cfg, batch))
    pos = np.zeros(batch, dtype=np.int64)
    min_gain = np.linspace(0.0, 0.3, batch).astype(np.float32)
    names = [i.name for i in sess.get_inputs()]
    worst, peak, energy, diff = 0.0, 0.0, 0.0, 0.0
    with torch.no_grad():
        joined = start == 0
        chunks = split_at(check_chunks(cfg.attention_window, n_steps), start)
        done = 0
        for t in tqdm(chunks, desc="onnxruntime vs torch", unit="call", disable=not progress, leave=False):
            joining = ~joined & (start <= done)
            if joining.any():  # a new stream takes the lane: clear its caches
                lanes = torch.from_numpy(joining)
                for a, b in zip(np_states, t_states):
                    a[joining] = 0.0
                    b[lanes] = 0.0
                np_rings[:, joining] = 0
                t_rings[:, lanes] = 0.0
                pos[joining] = 0
                joined |= joining
            hops = (rng.standard_normal((batch, t, cfg.stft.hop)) * 0.1).astype(np.float32)
            o = StepOutputs.decode(cfg, sess.run(None, dict(zip(names, [hops, min_gain, pos, *np_states,
                                                                         *ring_views(np_rings, int8)]))), onnx_out)
            r = StepOutputs.decode(cfg, step(torch.from_numpy(hops), torch.from_numpy(min_gain), torch.from_numpy(pos),
                                             *t_states, *t_rings))
            ref = r.out.numpy().astype(np.float64)
            done += t
            d = o.out - ref
            worst, peak = max(worst, float(np.abs(d).max())), max(peak, float(np.abs(ref).max()))
            energy, diff = energy + float((ref ** 2).sum()), diff + float((d ** 2).sum())
            write_rings(np_rings, o.kv_rows, pos, cfg.attention_window, keys_transposed=int8)
            write_rings(t_rings, r.kv_rows, torch.from_numpy(pos), cfg.attention_window)
            np_states, t_states = o.states, list(r.states)
            pos = pos + t
    snr = float("inf") if diff == 0 else float(10 * np.log10(energy / diff)) if energy > 0 else float("-inf")
    rel = 0.0 if worst == 0 else worst / peak if peak > 0 else float("inf")
    return {"max_abs_diff": worst, "max_rel_diff": rel, "parity_snr_db": snr, "positions": pos.tolist()}


def round_to_fp16(model):
    """Round every floating parameter and buffer to the nearest float16 value, in place (kept as
    float32). A model rounded like this is stored exactly by `export_step(fp16_weights=True)` and
    by `save_checkpoint(half=True)`."""
    import torch

    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_floating_point():
                t.copy_(t.half().float())
    return model


def _store_fp16(proto, min_elements: int = 1024) -> None:
    """Replace large float32 initializers that hold float16 values (the rounded weights, not the
    DFT bases) by float16 ones plus a Cast back to float32: lossless."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    casts = []
    for init in proto.graph.initializer:
        if init.data_type != TensorProto.FLOAT or int(np.prod(init.dims)) < min_elements:
            continue
        arr = numpy_helper.to_array(init)
        half = arr.astype(np.float16)
        if not np.array_equal(half.astype(np.float32), arr):
            continue
        name = init.name
        init.CopyFrom(numpy_helper.from_array(half, name + "__fp16"))
        casts.append(helper.make_node("Cast", [name + "__fp16"], [name], to=TensorProto.FLOAT, name=name + "__cast"))
    nodes = casts + list(proto.graph.node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    onnx.checker.check_model(proto)

