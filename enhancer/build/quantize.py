"""8-bit weights for the step graph: onnxruntime's `MatMulNBits` (weight-only, blockwise symmetric).

At batch 1 the step reads every weight once per 16 ms hop and does little arithmetic with it, so
its time is the time to stream ~28 MB of float32 weights through the memory hierarchy. Storing the
dense layers' weights as int8 (one float scale per block of 32) reads a quarter of that; with
`accuracy_level` 4 onnxruntime multiplies them with int8-quantized activations (VNNI/AMX on x86).

What is quantized: every dense layer with a constant weight (the pre-encoder convolutions, the
projections, the ordinary blocks' attention and FFN, the inter-mechanism attention's and the
output head's, and in the live body of the graph every TIM mechanism's layers) -- torch exports
them as `Gemm`, rewritten here as `MatMul` (+ bias) for the quantizer. What is not: the DFT bases
and the pitch filter's band and correlation matrices (they produce the audio or decide the
pitch, so they keep float32 precision), the attention over the key/value rings
(activations, not weights), and in the any-T body the grouped per-mechanism weights of TIM blocks
(3-D batched matmuls, which `MatMulNBits` does not take). `export_step` quantizes each body
before joining them (`enhancer.build.graph_switch`).
"""
from __future__ import annotations

import numpy as np

BLOCK_SIZE = 32
ACCURACY_LEVEL = 4  # int8 activations x int8 weights (level 0 computes in float32, slower)
KEEP_FLOAT = ("fwd_basis", "inv_basis", "pitch_member", "pitch_interp", "pitch_corr_fwd", "pitch_corr_inv")
MIN_PARITY_SNR_DB = 30.0  # export check: output energy over (int8 graph - torch) energy, random audio


def quantize_int8(proto, block_size: int = BLOCK_SIZE):
    """A copy of step graph `proto` with its dense weights as 8-bit `MatMulNBits` (bias folded in)."""
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    proto = _gemm_to_matmul(onnx.ModelProto.FromString(proto.SerializeToString()))
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
    out = _fold_bias(q.model.model)
    n = sum(node.op_type == "MatMulNBits" for node in out.graph.node)
    if n == 0:
        raise ValueError("the graph has no dense layer with a constant weight to quantize")
    return out


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
