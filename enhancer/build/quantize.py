"""8-bit dense layers for the step graph.

At batch 1 the step reads every weight once per 16 ms hop and does little arithmetic with it, so
its time is the time to stream ~28 MB of float32 weights through the memory hierarchy; at a dozen
streams and more, and in files (64 frames per call), the arithmetic counts. Two 8-bit forms, each
where it is the faster one (measured on a Sapphire Rapids Xeon, onnxruntime 1.31, one thread):

- layers of at least `ROW_INT8_MIN_WEIGHTS` weights (the pre-encoder's later convolutions, the
  ordinary blocks' attention and FFN, the inter-mechanism layers): `MatMulIntegerToFloat` (the 8-bit
  GEMM with its scales applied in its output stage), int8 weights with one scale per output column,
  against the input quantized row by row as the step runs: each row x gets the scale s = max|x| /
  127 (so no stream's or frame's row depends on another's) and two uint8 codes, q1 = round(x / s)
  and q2 = round(254 (x / s - q1)), its rounding error at 1/254 of the step, stacked as 2M rows of
  one product whose rows are scaled by s and s / 254 and columns by s_w; out comes the sum of the
  two halves. With one code the pre-encoder's later layers, whose inputs (after a LeakyReLU) hold
  their largest values in a few channels, came 4-10 dB further from their float products on speech;
  with the second, as close as their 8-bit weights allow. onnxruntime's 8-bit GEMM (VNNI; AMX where
  the CPU has it) runs a 16-row product of the 3,072 x 512 pre-encoder layer in 0.05 ms,
  `MatMulNBits` in 0.46 ms.
- the smaller ones (the TIM mechanisms' layers in the live body, the projections, the output
  head) and the first dense layer (the pre-encoder's first convolution, which reads the
  log-magnitude features; one scale per weight column loses the most there): `MatMulNBits`
  (weight-only, one float scale per block of 32, `accuracy_level` 4), one node each.

What stays float32: the DFT bases and the pitch filter's band and correlation matrices (they
produce the audio or decide the pitch), the attention over the key/value rings (activations, not
weights; `enhancer.build.ringquant`), and in the any-T body the grouped per-mechanism weights of
TIM blocks (3-D batched matmuls). torch exports dense layers as `Gemm`, rewritten here as `MatMul`
(+ bias) first. `export_step` quantizes each body before joining them (`enhancer.build.graph_switch`).
"""
from __future__ import annotations

import numpy as np

BLOCK_SIZE = 32
ACCURACY_LEVEL = 4  # MatMulNBits: int8 activations x int8 weights (level 0 computes in float32, slower)
ROW_INT8_MIN_WEIGHTS = 90_000  # dense layers with at least this many weights run on MatMulIntegerToFloat
KEEP_FLOAT = ("fwd_basis", "inv_basis", "pitch_member", "pitch_interp", "pitch_corr_c1", "pitch_corr_c4")
MIN_PARITY_SNR_DB = 30.0  # export check: output energy over (int8 graph - torch) energy, random audio


def quantize_int8(proto, row_min_weights: int = ROW_INT8_MIN_WEIGHTS, keep_first: bool = True):
    """A copy of step graph `proto` with its dense layers in 8 bits: those of at least
    `row_min_weights` weights on `MatMulIntegerToFloat` with row-quantized inputs (an input that feeds
    several of them is quantized once), the others as `MatMulNBits` (bias folded in)."""
    import onnx

    proto = _gemm_to_matmul(onnx.ModelProto.FromString(proto.SerializeToString()))
    n_rows = _row_int8(proto, row_min_weights, keep_first)
    out = _nbits(proto)
    if n_rows + sum(node.op_type == "MatMulNBits" for node in out.graph.node) == 0:
        raise ValueError("the graph has no dense layer with a constant weight to quantize")
    return out


def _row_int8(proto, min_weights: int, keep_first: bool) -> int:
    """Rewrite, in place, the dense layers of `proto` with at least `min_weights` constant weights
    (but the first, with `keep_first`) as `MatMulIntegerToFloat` on row-quantized inputs; returns how many."""
    from onnx import TensorProto, helper, numpy_helper

    g = proto.graph
    inits = {i.name: i for i in g.initializer}
    consts = [numpy_helper.from_array(np.asarray(v, dtype=t), n) for n, v, t in (
        ("q8/inv127", 1.0 / 127.0, np.float32), ("q8/tiny", 1e-30, np.float32), ("q8/one", 1.0, np.float32),
        ("q8/zp128", 128, np.uint8), ("q8/inv254", 1.0 / 254.0, np.float32))]
    quantized: dict[str, tuple[str, str]] = {}  # input -> (its uint8 rows, their scales)
    nodes, n_layers, first = [], 0, keep_first
    for n in g.node:
        w_name = n.input[1] if n.op_type == "MatMul" and len(n.input) == 2 else None
        w = inits.get(w_name) if w_name else None
        dense = w is not None and len(w.dims) == 2 and w.data_type == TensorProto.FLOAT and w_name not in KEEP_FLOAT
        if not dense or first or w.dims[0] * w.dims[1] < min_weights:
            first = first and not dense  # the first dense layer (it reads the features) stays on blocks
            nodes.append(n)
            continue
        x = n.input[0]
        if x not in quantized:
            t = f"q8/{len(quantized)}/"
            nodes += [
                helper.make_node("Abs", [x], [t + "abs"], name=t + "abs"),
                helper.make_node("ReduceMax", [t + "abs"], [t + "max"], axes=[-1], keepdims=1, name=t + "max"),
                helper.make_node("Mul", [t + "max", "q8/inv127"], [t + "s0"], name=t + "s0"),
                helper.make_node("Max", [t + "s0", "q8/tiny"], [t + "scale"], name=t + "scale"),
                helper.make_node("Div", [x, t + "scale"], [t + "x"], name=t + "x"),
                helper.make_node("QuantizeLinear", [t + "x", "q8/one", "q8/zp128"], [t + "q1"], name=t + "q1"),
                # the rounding error, in [-0.5, 0.5] of the first code, quantized again: rows M..2M
                helper.make_node("DequantizeLinear", [t + "q1", "q8/one", "q8/zp128"], [t + "d1"], name=t + "d1"),
                helper.make_node("Sub", [t + "x", t + "d1"], [t + "r"], name=t + "r"),
                helper.make_node("QuantizeLinear", [t + "r", "q8/inv254", "q8/zp128"], [t + "q2"], name=t + "q2"),
                helper.make_node("Concat", [t + "q1", t + "q2"], [t + "u8"], axis=-2, name=t + "u8"),
                # the rows' scales: s for the first codes, s / 254 for the second
                helper.make_node("Mul", [t + "scale", "q8/inv254"], [t + "s254"], name=t + "s254"),
                helper.make_node("Concat", [t + "scale", t + "s254"], [t + "scales"], axis=-2, name=t + "scales"),
            ]
            quantized[x] = (t + "u8", t + "scales")
        xq, sx = quantized[x]
        wf = numpy_helper.to_array(w).astype(np.float64)
        amax = np.abs(wf).max(axis=0)
        sw = np.where(amax > 0, amax / 127.0, 1.0)
        wq = np.clip(np.round(wf / sw), -127, 127).astype(np.int8)
        t = n.name + "__q8/"
        consts += [numpy_helper.from_array(wq, w_name + "__i8"),
                   numpy_helper.from_array(sw.astype(np.float32), w_name + "__i8_scale")]
        nodes += [  # both codes' rows scaled in the product's output stage, then summed
            helper.make_node("MatMulIntegerToFloat", [xq, w_name + "__i8", sx, w_name + "__i8_scale", "q8/zp128"],
                             [t + "f2"], name=t + "mm", domain="com.microsoft"),
            helper.make_node("Split", [t + "f2"], [t + "f1", t + "fr"], axis=-2, name=t + "split"),
            helper.make_node("Add", [t + "f1", t + "fr"], [n.output[0]], name=t + "sum"),
        ]
        n_layers += 1
    del g.node[:]
    g.node.extend(nodes)
    if n_layers:
        g.initializer.extend(consts)
    _drop_unused_initializers(proto)
    return n_layers


def _nbits(proto, block_size: int = BLOCK_SIZE):
    """`proto` with its remaining float dense layers (constant 2-D weights, not `KEEP_FLOAT`) as
    8-bit `MatMulNBits` (weight-only, blocks of `block_size`, bias folded in)."""
    import logging

    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    keep = [n.name for n in proto.graph.node if n.op_type == "MatMul" and any(b in n.input for b in KEEP_FLOAT)]
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, accuracy_level=ACCURACY_LEVEL,
                                          bits=8)
    quant_log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = quant_log.level
    quant_log.setLevel(logging.WARNING)  # it logs every node it skips at INFO
    try:
        q = MatMulNBitsQuantizer(proto, nodes_to_exclude=keep, algo_config=config)
        q.process()
    finally:
        quant_log.setLevel(level)
    return _fold_bias(q.model.model)


def _gemm_to_matmul(proto):
    """Gemm(x, W, b) with a constant W (transB 0 or 1, alpha = beta = 1) -> MatMul(x, W') + b."""
    from onnx import helper, numpy_helper

    g = proto.graph
    inits = {i.name: i for i in g.initializer}
    nodes = []
    for n in g.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if (n.op_type == "Gemm" and n.input[1] in inits and not attrs.get("transA", 0)
                and attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0):
            w = numpy_helper.to_array(inits[n.input[1]])
            if attrs.get("transB", 0):
                w = w.T
            name = n.input[1] + "__kn"
            g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w, dtype=np.float32), name))
            has_bias = len(n.input) > 2 and n.input[2]
            mid = n.output[0] + "__mm" if has_bias else n.output[0]
            nodes.append(helper.make_node("MatMul", [n.input[0], name], [mid], name=n.name + "__mm"))
            if has_bias:
                nodes.append(helper.make_node("Add", [mid, n.input[2]], [n.output[0]], name=n.name + "__bias"))
        else:
            nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    _drop_unused_initializers(proto)
    return proto


def _fold_bias(proto):
    """MatMulNBits followed by Add(constant 1-D bias of size N) -> MatMulNBits with its bias input."""
    from onnx import helper, numpy_helper

    g = proto.graph
    inits = {i.name: i for i in g.initializer}
    # the exporter shares equal constants (e.g. zero biases) through Identity nodes
    alias = {n.output[0]: n.input[0] for n in g.node if n.op_type == "Identity" and n.input[0] in inits}
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    graph_outputs = {o.name for o in g.output}
    drop = set()
    for n in g.node:
        if n.op_type != "MatMulNBits" or n.output[0] in graph_outputs:
            continue
        users = consumers.get(n.output[0], [])
        if len(users) != 1 or users[0].op_type != "Add":
            continue
        add = users[0]
        other = add.input[1] if add.input[0] == n.output[0] else add.input[0]
        other = alias.get(other, other)
        n_out = next(helper.get_attribute_value(a) for a in n.attribute if a.name == "N")
        if other not in inits or list(inits[other].dims) != [n_out]:
            continue
        if numpy_helper.to_array(inits[other]).dtype != np.float32:
            continue
        inputs = list(n.input) + [""] * (5 - len(n.input))  # A, B, scales, zero_points, g_idx
        del n.input[:]
        n.input.extend(inputs[:5] + [other])
        n.output[0] = add.output[0]
        drop.add(id(add))
    nodes = [n for n in g.node if id(n) not in drop]
    del g.node[:]
    g.node.extend(nodes)
    return proto


def _drop_unused_initializers(proto) -> None:
    used = {i for n in proto.graph.node for i in n.input} | {o.name for o in proto.graph.output}
    keep = [i for i in proto.graph.initializer if i.name in used]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(keep)
