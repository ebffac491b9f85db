"""One step graph with two bodies: the live step (T = 1) and any T, chosen per call by an `If`.

The torch step is traced twice, once with T fixed at 1 (the live step: the frame's own key/value
are single rows, so its self-attention is an elementwise product instead of B x H tiny matmuls,
and every shape is a constant) and once with T dynamic. `join_live_branch` puts both bodies under
one `If (T == 1)` node: the graph's inputs, outputs and names stay those of the dynamic graph,
the weights are stored once in the outer graph (equal tensors of the two traces are merged by
content) and both branches read them from there. onnxruntime runs only the branch taken.
"""
from __future__ import annotations

import hashlib

SWITCH = "frames_switch"  # name of the If node


def all_nodes(graph):
    """Every node of `graph` and of its subgraphs (the branches of an If), depth first."""
    from onnx import AttributeProto

    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.type == AttributeProto.GRAPH:
                yield from all_nodes(a.g)
            elif a.type == AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from all_nodes(g)


def join_live_branch(general, live):
    """A model with `general`'s inputs, outputs and metadata whose body is `If(frames == 1, live,
    general)`. Both protos must have the same input and output names (the same step traced at
    T = 1 and at dynamic T)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    in_names = [i.name for i in general.graph.input]
    out_names = [o.name for o in general.graph.output]
    if [i.name for i in live.graph.input] != in_names or [o.name for o in live.graph.output] != out_names:
        raise ValueError("the live and the general step graphs must have the same inputs and outputs")
    outer, by_content, taken = [], {}, set(in_names)

    def shared(init) -> str:
        """The outer initializer holding `init`'s tensor (added when no equal one is there yet)."""
        arr = numpy_helper.to_array(init)
        key = (init.data_type, tuple(init.dims), hashlib.sha256(arr.tobytes()).hexdigest())
        if key not in by_content:
            name, i = init.name, 0
            while name in taken:
                i += 1
                name = f"{init.name}__{i}"
            taken.add(name)
            copy = onnx.TensorProto()
            copy.CopyFrom(init)
            copy.name = name
            outer.append(copy)
            by_content[key] = name
        return by_content[key]

    def branch(proto, tag: str):
        weights = {i.name: shared(i) for i in proto.graph.initializer}

        def rename(v: str) -> str:
            if not v or v in in_names:
                return v
            return weights.get(v, f"{tag}/{v}")

        nodes = []
        for n in proto.graph.node:
            m = onnx.NodeProto()
            m.CopyFrom(n)
            m.name = f"{tag}/{n.name}"
            m.input[:] = [rename(v) for v in n.input]
            m.output[:] = [rename(v) for v in n.output]
            nodes.append(m)
        outs = []
        for o in proto.graph.output:
            src = rename(o.name)
            if src == o.name or src in weights.values():  # an input or a weight returned as it is
                nodes.append(helper.make_node("Identity", [src], [f"{tag}/{o.name}"], name=f"{tag}/{o.name}/identity"))
                src = f"{tag}/{o.name}"
            outs.append(helper.make_tensor_value_info(src, o.type.tensor_type.elem_type, None))
        return helper.make_graph(nodes, tag, [], outs)

    then_g, else_g = branch(live, "live"), branch(general, "any")
    hops = in_names[0]
    nodes = [
        helper.make_node("Shape", [hops], [f"{SWITCH}/frames"], start=1, end=2, name=f"{SWITCH}/frames"),
        helper.make_node("Constant", [], [f"{SWITCH}/one"], name=f"{SWITCH}/one",
                         value=helper.make_tensor("one", TensorProto.INT64, [1], [1])),
        helper.make_node("Equal", [f"{SWITCH}/frames", f"{SWITCH}/one"], [f"{SWITCH}/is_live_1d"], name=f"{SWITCH}/equal"),
        helper.make_node("Squeeze", [f"{SWITCH}/is_live_1d"], [f"{SWITCH}/is_live"], name=f"{SWITCH}/squeeze"),
        helper.make_node("If", [f"{SWITCH}/is_live"], out_names, name=SWITCH, then_branch=then_g, else_branch=else_g),
    ]
    graph = helper.make_graph(nodes, general.graph.name, list(general.graph.input), list(general.graph.output), outer)
    model = helper.make_model(graph, opset_imports=list(general.opset_import), ir_version=general.ir_version)
    model.producer_name, model.producer_version = general.producer_name, general.producer_version
    for entry in general.metadata_props:
        model.metadata_props.add().CopyFrom(entry)
    return model
