"""`enhancer bench --profile` (`enhancer.build.profile`): nodes counted inside subgraphs, constants left
out; kernel times summed by operator without control flow (its subgraphs' kernels count instead);
the command reports the step graph's nodes and where live steps and offline calls spend their time."""
import json

import numpy as np
import onnx
from onnx import TensorProto, helper

from enhancer.build.profile import kernel_times, node_counts
from enhancer.cli import main


def test_nodes_are_counted_inside_subgraphs_and_constants_are_not(tmp_path):
    def branch(name, ops):
        nodes = [helper.make_node("Constant", [], ["c"], value=helper.make_tensor("v", TensorProto.FLOAT, [], [1.0]))]
        last = "x"
        for i, op in enumerate(ops):
            nodes.append(helper.make_node(op, [last, "c"], [f"{name}{i}"]))
            last = f"{name}{i}"
        nodes.append(helper.make_node("Identity", [last], [f"{name}_out"]))
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [1])])

    then_g, else_g = branch("t", ["Add", "Mul", "Add"]), branch("e", ["Mul"])
    nodes = [helper.make_node("Constant", [], ["k"], value=helper.make_tensor("w", TensorProto.FLOAT, [1], [2.0])),
             helper.make_node("Greater", ["x", "k"], ["cond0"]),
             helper.make_node("Squeeze", ["cond0"], ["cond"]),
             helper.make_node("If", ["cond"], ["y"], name="switch", then_branch=then_g, else_branch=else_g)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "m.onnx")
    n = node_counts(tmp_path / "m.onnx")
    assert n["top"] == 3 and n["branches"] == {"switch.then_branch": 4, "switch.else_branch": 2}
    assert n["by_op"] == {"Add": 2, "Identity": 2, "Mul": 2, "Greater": 1, "Squeeze": 1, "If": 1}
    assert n["total"] == 9 == sum(n["by_op"].values())


def test_kernel_times_add_up_by_operator_without_control_flow(tmp_path):
    events = [{"cat": "Session", "name": "model_run", "dur": 1000},
              {"cat": "Node", "name": "a_kernel_time", "dur": 10, "args": {"op_name": "MatMul"}},
              {"cat": "Node", "name": "a_fence_before", "dur": 99, "args": {"op_name": "MatMul"}},
              {"cat": "Node", "name": "b_kernel_time", "dur": 5, "args": {"op_name": "MatMul"}},
              {"cat": "Node", "name": "c_kernel_time", "dur": 7, "args": {"op_name": "Add"}},
              {"cat": "Node", "name": "switch_kernel_time", "dur": 30, "args": {"op_name": "If"}}]
    (tmp_path / "p.json").write_text(json.dumps(events))
    assert kernel_times(tmp_path / "p.json") == {"MatMul": 15.0, "Add": 7.0}


def test_bench_profile_reports_nodes_and_kernel_time(model_path, capsys):
    assert main(["bench", "--model", str(model_path), "--profile", "--steps", "5", "--batches", "3", "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)
    nodes, kernels = r["nodes"], r["kernels"]
    assert nodes["total"] == sum(nodes["by_op"].values()) > nodes["top"] > 0
    assert len(nodes["branches"]) == 2 and nodes["by_op"]["If"] == 1  # the step graph's one-frame / many-frame switch
    live, offline = kernels["live"], kernels["offline"]
    assert (live["batch"], live["frames_per_call"], live["calls"]) == (3, 1, 5) and offline["frames_per_call"] > 1
    for k, unit in ((live, "ms_per_step"), (offline, "ms_per_hop")):
        ms = k[unit]
        assert "If" not in ms and any(op.startswith("MatMul") or op == "Gemm" for op in ms)
        assert all(v >= 0 for v in ms.values()) and np.isclose(k["total_ms"], sum(ms.values())) and k["total_ms"] > 0
    assert main(["bench", "--model", str(model_path), "--profile", "--steps", "2", "--batches", "2"]) == 0
    text = capsys.readouterr().out
    assert "nodes (not constants)" in text and "live: batch 2" in text and "offline: batch 1" in text


def test_the_shipped_live_step_computes_no_shapes():
    """The live body (T = 1) is traced with the frame count fixed, so its reshapes, slices and
    masks take constant shapes: no node of it reads a tensor's shape at run time (each would be a
    kernel call per step), while the many-frame body still does (T varies)."""
    from tests.golden_update import shipped_model

    model = onnx.load(str(shipped_model()), load_external_data=False)
    switch = next(n for n in model.graph.node if n.op_type == "If")
    ops = {a.name: {n.op_type for n in a.g.node} for a in switch.attribute}
    assert "Shape" not in ops["then_branch"] and "Shape" in ops["else_branch"]
