"""8-bit key/value rings for the step graph.

A live step reads every stream's key/value rings (8 layers x keys and values x 16 heads x 128
slots x 19) once per 16 ms hop: 2.5 MB per stream in float32, so from a dozen streams on they come
from memory, and each head's two products with them are tiny matrix products whose cost is mostly
per-product overhead. Stored as int8 the rings are a quarter of the bytes, and onnxruntime's
`MatMulInteger` (uint8 x int8) takes about a third of the time per product.

The encoding, per layer and head, with scales calibrated on audio (`calibrate_rings`):

- keys and values: symmetric int8, `round(x / s)` saturated to [-128, 127], one scale `s` per
  (ring, head): the largest magnitude seen in calibration times `HEADROOM`, over 127. The graph
  quantizes the new rows it returns (`kv_rows` is int8), so the caller writes int8 rows.
- key rings are stored transposed, (B, H, dh, W), so that the scores of the live step are one
  `MatMulInteger` per stream and group of `HEADS_PER_PRODUCT` heads: the group's queries as the
  rows of a (G, G dh) block-diagonal matrix (the zero point off the blocks, so the product is
  exact) against its key rings as one (G dh, W) matrix. One product per head is mostly per-product
  overhead; one per stream (all 16 heads) does 16 times the arithmetic; groups of 4 took 0.76-0.78
  of the time of either on an AMD EPYC Zen 4 (8 layers of 16 streams' scores). Value rings stay
  (B, H, W, dh), one product per head (grouped, the value side was slower).
  `step_io.write_rings(keys_transposed=True)` writes both layouts.
- the live step's query: uint8 with zero point 128 and one scale per stream and head (its largest
  magnitude over 127), times the key scale folded in beforehand.
- the live step's attention weights over the ring (in [0, 1]): uint8 with the fixed scale 1/255.

The any-T body (files, backlogs) dequantizes the rings it reads and attends in float32 otherwise;
so live and chunked runs of the same audio no longer agree bit for bit, but within the
quantization (the export's check reports how far from torch the graph is, `parity_snr_db`).
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..step_io import RING_FORMATS  # noqa: F401  (the formats the runtime reads)

HEADROOM = 1.5  # scale = HEADROOM * calibrated max / 127: rows louder than calibration saturate later
P_SCALE = 1.0 / 255.0  # attention weights in [0, 1] as uint8
HEADS_PER_PRODUCT = 4  # heads whose ring scores are one MatMulInteger (a divisor of the head count)
CALIBRATION_FRAMES = 128  # frames per call when calibrating (the offline path)
MIN_CALIBRATION_SECONDS = 1.0


def calibrate_rings(engine, signals: Iterable[np.ndarray]) -> tuple[np.ndarray, float]:
    """Largest |key| and |value| per (ring, head), shape (2N, H), of float step graph `engine`
    run over `signals` (16 kHz mono float32 arrays, each a fresh stream, in calls of
    `CALIBRATION_FRAMES` frames). Returns it and the seconds of audio seen."""
    from ..step_io import init_rings, init_states, write_rings

    cfg = engine.config
    if engine.int8_rings:
        raise ValueError(f"{engine.path}: calibrate on a graph with float32 rings")
    hop, n_rings = cfg.stft.hop, 2 * cfg.n_layers
    amax = np.zeros((n_rings, cfg.n_heads), dtype=np.float64)
    seconds = 0.0
    for x in signals:
        x = np.asarray(x, dtype=np.float32).reshape(-1)
        n = x.shape[0] // hop
        if n == 0:
            continue
        seconds += n * hop / cfg.stft.sample_rate
        states, rings = init_states(cfg, 1), init_rings(cfg, 1)
        pos = np.zeros(1, dtype=np.int64)
        gain = np.zeros(1, dtype=np.float32)
        hops = x[: n * hop].reshape(1, n, hop)
        for a in range(0, n, CALIBRATION_FRAMES):
            h = np.ascontiguousarray(hops[:, a:a + CALIBRATION_FRAMES])
            o = engine.run(h, gain, pos, [*states, *rings])
            rows = o.kv_rows.reshape(1, cfg.n_heads, n_rings, -1, cfg.head_dim)
            amax = np.maximum(amax, np.abs(rows).max(axis=(0, 3, 4)).T)
            write_rings(rings, o.kv_rows, pos, cfg.attention_window)
            states, pos = o.states, pos + h.shape[1]
    if seconds < MIN_CALIBRATION_SECONDS:
        raise ValueError(f"calibrating 8-bit rings needs at least {MIN_CALIBRATION_SECONDS:g} s of audio, got {seconds:.2f} s")
    if not np.isfinite(amax).all():
        raise ValueError("the graph's keys or values are not finite on the calibration audio")
    return amax.astype(np.float32), seconds


def graph_ring_scales(path) -> tuple[np.ndarray, str]:
    """The per-(ring, head) scales (2N, H) of the 8-bit rings of an exported step graph, and the
    seconds of audio they were calibrated on (its metadata): to export again with the same rings."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    found = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name.startswith("rq/s")}
    keys = sorted((n for n in found if n.startswith("rq/sk") and n.endswith("_axis")), key=lambda n: int(n[5:-5]))
    if not keys:
        raise ValueError(f"{path}: not a step graph with 8-bit key/value rings")
    rows = [found[k] for k in keys] + [found.get(k.replace("rq/sk", "rq/sv")) for k in keys]
    if any(r is None for r in rows):
        raise ValueError(f"{path}: its ring scales are incomplete")
    meta = {e.key: e.value for e in model.metadata_props}
    return np.stack(rows).astype(np.float32), meta.get("tim_enhancer.ring_calibration_seconds", "?")


def ring_scales(amax: np.ndarray, headroom: float = HEADROOM) -> np.ndarray:
    """Per-(ring, head) int8 scales from calibrated maxima (2N, H); a ring that stayed 0 gets 1/127."""
    a = np.asarray(amax, dtype=np.float32)
    return np.where(a > 0, headroom * a / 127.0, 1.0 / 127.0).astype(np.float32)


def quantize_rings(proto, scales: np.ndarray, heads_per_product: int = HEADS_PER_PRODUCT):
    """A copy of joined step graph `proto` (`graph_switch.join_live_branch`, float32 rings) whose
    rings are int8 with per-(ring, head) `scales` (2N, H): key inputs (B, H, dh, W), value inputs
    (B, H, W, dh), `kv_rows` int8; the live body's ring products on `MatMulInteger`, the any-T body
    on the dequantized rings."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from .graph_switch import SWITCH

    m = onnx.ModelProto.FromString(proto.SerializeToString())
    g = m.graph
    switch = [n for n in g.node if n.op_type == "If" and n.name == SWITCH]
    if not switch:
        raise ValueError("not a joined step graph (no live/any-T switch)")
    branches = {a.name: a.g for a in switch[0].attribute}
    live, anyt = branches["then_branch"], branches["else_branch"]
    ring_inputs = [i for i in g.input if len(i.name) > 1 and i.name[0] in "kv" and i.name[1:].isdigit()]
    n_layers = len(ring_inputs) // 2
    dims = [d.dim_value for d in ring_inputs[0].type.tensor_type.shape.dim]  # [batch, H, W, dh]
    _, n_heads, window, head_dim = dims
    scales = np.asarray(scales, dtype=np.float32)
    if scales.shape != (2 * n_layers, n_heads):
        raise ValueError(f"ring scales of shape {scales.shape}, the graph needs {(2 * n_layers, n_heads)}")
    if any(i.type.tensor_type.elem_type != TensorProto.FLOAT for i in ring_inputs):
        raise ValueError("the graph's rings are not float32 (already quantized?)")

    consts = []

    def const(name: str, value, dtype=np.float32) -> str:
        consts.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    zp_u8, zero_u8 = const("rq/zp128", 128, np.uint8), const("rq/zp0", 0, np.uint8)
    zero_i8, one = const("rq/zp0_i8", 0, np.int8), const("rq/one", 1.0)
    inv127, tiny, p_scale = const("rq/inv127", 1.0 / 127.0), const("rq/tiny", 1e-30), const("rq/p_scale", P_SCALE)

    hg = heads_per_product if n_heads % heads_per_product == 0 else n_heads
    groups = n_heads // hg
    if hg > 1:  # the block-diagonal queries' shapes
        q_pads = const("rq/q_pads", [0, 0, 0, 0, 0, 0, 0, hg * head_dim], np.int64)
        q_flat = const("rq/q_flat", [-1, groups, hg * (hg + 1) * head_dim], np.int64)
        q_cut = const("rq/q_cut", [hg * hg * head_dim], np.int64)
        zero_i64, two_i64 = const("rq/zero_i64", [0], np.int64), const("rq/two_i64", [2], np.int64)
        q_rows = const("rq/q_rows", [-1, groups, hg, hg * head_dim], np.int64)
        k_rows = const("rq/k_rows", [-1, groups, hg * head_dim, window], np.int64)
        s_shape = const("rq/s_shape", [-1, n_heads, 1, window], np.int64)

    def consumers(nodes, name: str):
        return [n for n in nodes if name in n.input]

    live_nodes = list(live.node)
    for j in range(n_layers):
        k, v = f"k{j}", f"v{j}"
        sk, sv = scales[j], scales[n_layers + j]
        head = (1, n_heads, 1, 1)
        # ---- live body: the scores q @ K^T on MatMulInteger
        tr = _single(consumers(live_nodes, k), "Transpose", k)
        mm = _single(consumers(live_nodes, tr.output[0]), "MatMul", tr.output[0])
        q, s = mm.input[0], mm.output[0]
        t = f"live/rq{j}/"
        sk_c = const(f"rq/sk{j}", sk.reshape(head))
        new = [
            helper.make_node("Mul", [q, sk_c], [t + "q"], name=t + "q_scale"),  # q . (s_k K_int) = (q s_k) . K_int
            helper.make_node("Abs", [t + "q"], [t + "q_abs"], name=t + "q_abs"),
            helper.make_node("ReduceMax", [t + "q_abs"], [t + "q_max"], axes=[-1], keepdims=1, name=t + "q_max"),
            helper.make_node("Mul", [t + "q_max", inv127], [t + "sq0"], name=t + "sq0"),
            helper.make_node("Max", [t + "sq0", tiny], [t + "sq"], name=t + "sq"),
            helper.make_node("Div", [t + "q", t + "sq"], [t + "q_n"], name=t + "q_n"),
            helper.make_node("QuantizeLinear", [t + "q_n", one, zp_u8], [t + "q_u8"], name=t + "q_u8"),
            # a group of G heads of a stream in one product: row h of (G, G dh) holds head h's query
            # in block h and the zero point elsewhere, against the group's key rings as one (G dh, W)
            # matrix. Each query padded with G dh zero points, a group's G rows laid end to end and
            # cut after G G dh values are that matrix: query h starts at h (G + 1) dh = h (G dh) + h dh.
        ] + ([  # one product per head: (1, dh) against (dh, W)
            helper.make_node("MatMulInteger", [t + "q_u8", k, zp_u8], [t + "s_i32"], name=t + "scores"),
        ] if hg == 1 else [
            helper.make_node("Pad", [t + "q_u8", q_pads, zp_u8], [t + "q_padded"], name=t + "q_padded"),
            helper.make_node("Reshape", [t + "q_padded", q_flat], [t + "q_flat"], name=t + "q_flat"),
            helper.make_node("Slice", [t + "q_flat", zero_i64, q_cut, two_i64], [t + "q_blocks"], name=t + "q_blocks"),
            helper.make_node("Reshape", [t + "q_blocks", q_rows], [t + "q_rows"], name=t + "q_rows"),
            helper.make_node("Reshape", [k, k_rows], [t + "k_rows"], name=t + "k_rows"),
            helper.make_node("MatMulInteger", [t + "q_rows", t + "k_rows", zp_u8], [t + "s_rows"], name=t + "scores"),
            helper.make_node("Reshape", [t + "s_rows", s_shape], [t + "s_i32"], name=t + "s_heads"),
        ]) + [
            helper.make_node("Cast", [t + "s_i32"], [t + "s_f"], to=TensorProto.FLOAT, name=t + "s_f"),
            helper.make_node("Mul", [t + "s_f", t + "sq"], [s], name=t + "s"),
        ]
        live_nodes = _replace(live_nodes, [tr, mm], new)
        # ---- live body: the context p @ V on MatMulInteger
        pv = _single(consumers(live_nodes, v), "MatMul", v)
        p, c = pv.input[0], pv.output[0]
        sv_c = const(f"rq/sv{j}_p", (sv * P_SCALE).reshape(head))
        new = [
            helper.make_node("QuantizeLinear", [p, p_scale, zero_u8], [t + "p_u8"], name=t + "p_u8"),
            helper.make_node("MatMulInteger", [t + "p_u8", v], [t + "c_i32"], name=t + "context"),
            helper.make_node("Cast", [t + "c_i32"], [t + "c_f"], to=TensorProto.FLOAT, name=t + "c_f"),
            helper.make_node("Mul", [t + "c_f", sv_c], [c], name=t + "c"),
        ]
        live_nodes = _replace(live_nodes, [pv], new)
        # ---- any-T body: dequantize what it reads (its key Transpose becomes the dequantization)
        atr = _single(consumers(anyt.node, k), "Transpose", k)
        deq_k = helper.make_node("DequantizeLinear", [k, const(f"rq/sk{j}_axis", sk)], [atr.output[0]], axis=1,
                                 name=f"any/rq{j}/k")
        vf = f"any/rq{j}/v_f"
        deq_v = helper.make_node("DequantizeLinear", [v, const(f"rq/sv{j}_axis", sv)], [vf], axis=1, name=f"any/rq{j}/v")
        for n in consumers(anyt.node, v):
            n.input[:] = [vf if x == v else x for x in n.input]
        nodes = [deq_k, deq_v] + [n for n in anyt.node if n is not atr]
        del anyt.node[:]
        anyt.node.extend(nodes)
    _topological(live, live_nodes, outer=_outer_names(g) | {c.name for c in consts})

    # ---- the new rows, quantized once after either body: kv_rows (B, H, 2N * T, dh) -> int8
    out_i = list(switch[0].output).index("kv_rows")
    switch[0].output[out_i] = "rq/kv_rows_f"
    inv = const("rq/inv_scales", (1.0 / scales).T.reshape(1, n_heads, 2 * n_layers, 1, 1))
    split = const("rq/rows_shape", [0, n_heads, 2 * n_layers, -1, head_dim], np.int64)
    back = const("rq/flat_shape", [0, n_heads, -1, head_dim], np.int64)
    g.node.extend([
        helper.make_node("Reshape", ["rq/kv_rows_f", split], ["rq/rows"], name="rq/rows"),
        helper.make_node("Mul", ["rq/rows", inv], ["rq/rows_n"], name="rq/rows_n"),
        helper.make_node("QuantizeLinear", ["rq/rows_n", one, zero_i8], ["rq/rows_i8"], name="rq/rows_i8"),
        helper.make_node("Reshape", ["rq/rows_i8", back], ["kv_rows"], name="rq/kv_rows"),
    ])
    g.initializer.extend(consts)
    for i in ring_inputs:
        i.type.tensor_type.elem_type = TensorProto.INT8
        if i.name.startswith("k"):  # keys transposed: (batch, H, dh, W)
            d = i.type.tensor_type.shape.dim
            d[2].dim_value, d[3].dim_value = head_dim, window
    for o in g.output:
        if o.name == "kv_rows":
            o.type.tensor_type.elem_type = TensorProto.INT8
    return m


def _single(nodes, op: str, what: str):
    if len(nodes) != 1 or nodes[0].op_type != op:
        raise ValueError(f"unexpected step graph: {what} feeds {[n.op_type for n in nodes]}, expected one {op}")
    return nodes[0]


def _replace(nodes, old, new):
    """`nodes` with the nodes of `old` removed and `new` put where the first of them was."""
    at = next(i for i, n in enumerate(nodes) if any(n is o for o in old))  # nothing before it is removed
    kept = [n for n in nodes if all(n is not o for o in old)]
    return kept[:at] + new + kept[at:]


def _outer_names(graph) -> set[str]:
    return ({i.name for i in graph.input} | {i.name for i in graph.initializer}
            | {o for n in graph.node for o in n.output})


def _topological(graph, nodes, outer: set[str]) -> None:
    """Put `nodes` into `graph` in an order where every input is produced before it is used."""
    have, ordered, pending = set(outer), [], list(nodes)
    while pending:
        rest = []
        for n in pending:
            if all((not i) or i in have for i in n.input):
                ordered.append(n)
                have.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            raise ValueError(f"cannot order the live body: {rest[0].op_type} {rest[0].name} misses an input")
        pending = rest
    del graph.node[:]
    graph.node.extend(ordered)
