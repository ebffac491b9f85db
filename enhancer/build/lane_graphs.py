"""The lane graphs (`enhancer.lane_graphs`) built with `onnx`: `build()` writes what ships in
enhancer/graphs/ (`tests/enhancer/test_device_pool.py` checks that the files are what it writes)."""
from __future__ import annotations

from pathlib import Path

from ..lane_graphs import GRAPHS_DIR, OPSET


def build() -> dict:
    """The graphs as onnx ModelProtos, by name (needs the `onnx` package)."""
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper as h

    def i64(name, values):
        return h.make_node("Constant", [], [name], value=h.make_tensor(name, TP.INT64, [len(values)], values))

    def model(name, nodes, inputs, outputs, what="an in-place ScatterND update of a device lane pool"):
        g = h.make_graph(nodes, name, inputs, outputs)
        m = h.make_model(g, opset_imports=[h.make_opsetid("", OPSET)], producer_name="tim-enhancer")
        m.ir_version = 8
        m.doc_string = f"tim-enhancer lane graph {name}: {what}"
        onnx.checker.check_model(m, full_check=True)
        return m

    f32, i64t = TP.FLOAT, TP.INT64
    vi = h.make_tensor_value_info
    graphs = {}

    # the rings: updates (M, k, H, S, D) at indices (M, k, H, S, 4) = (ring, lane, head, slot)
    nodes = [
        h.make_node("Gather", ["kv_rows", "sel"], ["picked"], axis=0),  # (k, H, M*T, D)
        h.make_node("Shape", ["rings"], ["rshape"]),  # M, C, H, W, D
        h.make_node("Shape", ["lanes"], ["kshape"]),  # k
        h.make_node("Shape", ["slots"], ["sshape"]),  # k, S
        h.make_node("Shape", ["picked"], ["pshape"]),  # k, H, M*T, D
        i64("c0", [0]), i64("c1", [1]), i64("c2", [2]), i64("c3", [3]), i64("c4", [4]), i64("c5", [5]),
        i64("m1", [-1]), i64("big", [2 ** 62]),
        h.make_node("Slice", ["rshape", "c0", "c1"], ["M"]),
        h.make_node("Slice", ["rshape", "c2", "c3"], ["H"]),
        h.make_node("Slice", ["rshape", "c4", "c5"], ["D"]),
        h.make_node("Slice", ["sshape", "c1", "c2"], ["S"]),
        h.make_node("Slice", ["pshape", "c2", "c3"], ["MT"]),
        h.make_node("Div", ["MT", "M"], ["T"]),
        h.make_node("Concat", ["kshape", "H", "M", "T", "D"], ["shape5"], axis=0),
        h.make_node("Reshape", ["picked", "shape5"], ["rows5"]),  # (k, H, M, T, D)
        h.make_node("Sub", ["T", "S"], ["first"]),
        h.make_node("Slice", ["rows5", "first", "big", "c3"], ["last"]),  # the last S frames
        h.make_node("Transpose", ["last"], ["updates"], perm=[2, 0, 1, 3, 4]),  # (M, k, H, S, D)
        h.make_node("Concat", ["M", "kshape", "H", "S"], ["ishape"], axis=0),
        h.make_node("Squeeze", ["M"], ["Ms"]), h.make_node("Squeeze", ["H"], ["Hs"]),
        h.make_node("Constant", [], ["zero"], value=h.make_tensor("zero", TP.INT64, [], [0])),
        h.make_node("Constant", [], ["step"], value=h.make_tensor("step", TP.INT64, [], [1])),
        h.make_node("Range", ["zero", "Ms", "step"], ["mr"]),
        h.make_node("Range", ["zero", "Hs", "step"], ["hr"]),
        h.make_node("Concat", ["M", "c1", "c1", "c1"], ["mshape"], axis=0),
        h.make_node("Concat", ["c1", "kshape", "c1", "c1"], ["lshape"], axis=0),
        h.make_node("Concat", ["c1", "c1", "H", "c1"], ["hshape"], axis=0),
        h.make_node("Concat", ["c1", "kshape", "c1", "S"], ["sshape4"], axis=0),
        h.make_node("Reshape", ["mr", "mshape"], ["m4"]),
        h.make_node("Reshape", ["lanes", "lshape"], ["l4"]),
        h.make_node("Reshape", ["hr", "hshape"], ["h4"]),
        h.make_node("Reshape", ["slots", "sshape4"], ["s4"]),
    ]
    for src in ("m4", "l4", "h4", "s4"):
        nodes.append(h.make_node("Expand", [src, "ishape"], [src + "e"]))
        nodes.append(h.make_node("Unsqueeze", [src + "e", "m1"], [src + "u"]))
    nodes.append(h.make_node("Concat", ["m4u", "l4u", "h4u", "s4u"], ["index"], axis=-1))  # (M, k, H, S, 4)

    # lane_writer: one call per step for the rings (the nodes above) and every state at once. The
    # states live in one flat buffer, state after state, each (C, L_j); the step's updated states in
    # another, each (K, L_j). Per element e of a lane's states (all states in a row: Ltot): cum[e] =
    # sum of L_i before its state, size[e] = L_j, at[e] = its place in the row. Row sel[i] of the
    # step goes to lane lanes[i]: from K*cum + sel*size + at to C*cum + lanes*size + at.
    lw = list(nodes)
    lw.append(h.make_node("ScatterND", ["rings", "index", "updates"], ["rings_out"]))
    lw += [
        h.make_node("Unsqueeze", ["sel", "c1"], ["sel2"]),  # (k, 1)
        h.make_node("Unsqueeze", ["lanes", "c1"], ["lanes2"]),
        h.make_node("Mul", ["K", "cum"], ["src0"]), h.make_node("Mul", ["C", "cum"], ["dst0"]),
        h.make_node("Add", ["src0", "at"], ["src1"]), h.make_node("Add", ["dst0", "at"], ["dst1"]),
        h.make_node("Mul", ["sel2", "size"], ["src2"]), h.make_node("Mul", ["lanes2", "size"], ["dst2"]),
        h.make_node("Add", ["src2", "src1"], ["src"]), h.make_node("Add", ["dst2", "dst1"], ["dst"]),  # (k, Ltot)
        h.make_node("Reshape", ["src", "m1"], ["src_flat"]), h.make_node("Reshape", ["dst", "m1"], ["dst_flat"]),
        h.make_node("Gather", ["nexts", "src_flat"], ["moved"], axis=0),
        h.make_node("ScatterElements", ["states", "dst_flat", "moved"], ["states_out"], axis=0),
    ]
    graphs["lane_writer"] = model("lane_writer", lw, [
        vi("rings", f32, ["M", "C", "H", "W", "D"]), vi("kv_rows", f32, ["K", "H", "MT", "D"]),
        vi("sel", i64t, ["k"]), vi("lanes", i64t, ["k"]), vi("slots", i64t, ["k", "S"]),
        vi("states", f32, ["CL"]), vi("nexts", f32, ["KL"]), vi("cum", i64t, ["Ltot"]), vi("size", i64t, ["Ltot"]),
        vi("at", i64t, ["Ltot"]), vi("K", i64t, [1]), vi("C", i64t, [1])],
        [vi("rings_out", f32, ["M", "C", "H", "W", "D"]), vi("states_out", f32, ["CL"])])

    def row_index(length: bool) -> list:
        """Nodes of the indices (M, k, 2) = (block, lane) of rows `lanes` of data (M, C, L) ("index"),
        with "M", "kshape" and, if `length`, "L" (the rows' length)."""
        c23 = [i64("c2", [2]), i64("c3", [3])] if length else []
        return [
            h.make_node("Shape", ["data"], ["dshape"]),
            h.make_node("Shape", ["lanes"], ["kshape"]),
            i64("c0", [0]), i64("c1", [1]), *c23, i64("m1", [-1]),
            h.make_node("Slice", ["dshape", "c0", "c1"], ["M"]),
            *([h.make_node("Slice", ["dshape", "c2", "c3"], ["L"])] if length else []),
            h.make_node("Squeeze", ["M"], ["Ms"]),
            h.make_node("Constant", [], ["zero"], value=h.make_tensor("zero", TP.INT64, [], [0])),
            h.make_node("Constant", [], ["step"], value=h.make_tensor("step", TP.INT64, [], [1])),
            h.make_node("Range", ["zero", "Ms", "step"], ["mr"]),
            h.make_node("Concat", ["M", "c1"], ["mshape"], axis=0),
            h.make_node("Concat", ["c1", "kshape"], ["lshape"], axis=0),
            h.make_node("Concat", ["M", "kshape"], ["ishape"], axis=0),
            h.make_node("Reshape", ["mr", "mshape"], ["m2"]),
            h.make_node("Reshape", ["lanes", "lshape"], ["l2"]),
            h.make_node("Expand", ["m2", "ishape"], ["me"]),
            h.make_node("Expand", ["l2", "ishape"], ["le"]),
            h.make_node("Unsqueeze", ["me", "m1"], ["mu"]),
            h.make_node("Unsqueeze", ["le", "m1"], ["lu"]),
            h.make_node("Concat", ["mu", "lu"], ["index"], axis=-1),  # (M, k, 2)
        ]

    data, lanes_in = vi("data", f32, ["M", "C", "L"]), vi("lanes", i64t, ["k"])
    # zero_rows: indices (M, k, 2) = (block, lane), updates zeros (M, k, L)
    graphs["zero_rows"] = model("zero_rows", row_index(True) + [
        h.make_node("Concat", ["M", "kshape", "L"], ["zshape"], axis=0),
        h.make_node("ConstantOfShape", ["zshape"], ["zeros"], value=h.make_tensor("v", TP.FLOAT, [1], [0.0])),
        h.make_node("ScatterND", ["data", "index", "zeros"], ["out"]),
    ], [data, lanes_in], [vi("out", f32, ["M", "C", "L"])])

    # gather_rows: data (M, C, L), lanes (k,) -> rows (M, k, L), the lanes' rows of each block (a
    # lane's state handed out: `DeviceLanePool.export_lanes`, the output bound on the host)
    graphs["gather_rows"] = model("gather_rows", [h.make_node("Gather", ["data", "lanes"], ["rows"], axis=1)],
                                  [data, lanes_in], [vi("rows", f32, ["M", "k", "L"])],
                                  what="a copy of rows of a device lane pool")

    # scatter_rows: data with rows `lanes` of each block set to rows (M, k, L) (`import_lanes`)
    graphs["scatter_rows"] = model("scatter_rows", row_index(False) + [
        h.make_node("ScatterND", ["data", "index", "rows"], ["out"]),
    ], [data, lanes_in, vi("rows", f32, ["M", "k", "L"])], [vi("out", f32, ["M", "C", "L"])])
    return graphs


def write(folder: Path = GRAPHS_DIR) -> list[Path]:
    """Write the graphs as `folder/NAME.onnx` (development: `python -m enhancer.build.lane_graphs`)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, m in build().items():
        p = folder / f"{name}.onnx"
        p.write_bytes(m.SerializeToString(deterministic=True))
        out.append(p)
    return out


if __name__ == "__main__":
    for p in write():
        print(p)
