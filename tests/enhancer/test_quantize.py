"""8-bit weights (`enhancer export --int8`): what is quantized, how close the output stays, errors."""
import json

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

import enhancer
from enhancer.build.export import export_step
from enhancer.build.graph_switch import all_nodes
from enhancer.build.quantize import MIN_PARITY_SNR_DB, quantize_int8
from enhancer.cli import main
from enhancer.runtime import Enhancer
from tests.conftest import speechlike
from tests.tolerance import snr_db


@pytest.fixture(scope="module")
def int8_path(torch_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("int8") / "tim-int8.onnx"
    report = export_step(torch_model, path, int8_weights=True)
    assert report["weights"] == "int8"
    assert report["parity_snr_db"] >= MIN_PARITY_SNR_DB  # against torch, step by step, rings wrapping
    assert 0 < report["max_rel_diff"] < 0.1 and report["max_abs_diff"] > 0  # not exact, but close to torch
    return path


def test_dense_weights_become_int8_blocks_and_the_dft_stays_float(int8_path, model_path):
    q, f = onnx.load(str(int8_path)), onnx.load(str(model_path))
    q_nodes, f_nodes = list(all_nodes(q.graph)), list(all_nodes(f.graph))  # both branches of the frames switch
    ops = [n.op_type for n in q_nodes]
    # every Gemm (pre-encoder convolutions, projections, ordinary blocks, inter-mechanism attention, head)
    n_gemm = sum(n.op_type == "Gemm" for n in f_nodes)
    assert "Gemm" not in ops and ops.count("MatMulNBits") == n_gemm > 20
    inits = {i.name: numpy_helper.to_array(i) for i in q.graph.initializer}
    assert inits["fwd_basis"].dtype == np.float32 and inits["inv_basis"].dtype == np.float32
    mm_out = set()
    for n in q_nodes:
        if n.op_type == "MatMulNBits":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            assert attrs["bits"] == 8 and attrs["block_size"] == 32 and inits[n.input[1]].dtype == np.uint8
            mm_out.add(n.output[0])
    # biases are folded into MatMulNBits: no Add of a constant follows one
    assert not [n for n in q_nodes if n.op_type == "Add" and set(n.input) & mm_out and set(n.input) & set(inits)]
    assert sum(len(n.input) == 6 for n in q_nodes if n.op_type == "MatMulNBits") >= n_gemm // 2
    meta = {p.key: p.value for p in q.metadata_props}
    assert meta["tim_enhancer.weights"] == "int8"
    assert int8_path.stat().st_size < 0.7 * model_path.stat().st_size


def test_int8_runtime_stays_close_to_float32(int8_path, enhancer_rt):
    enh = Enhancer.from_pretrained(int8_path, providers=["CPUExecutionProvider"])
    assert enh.engine.weights == "int8" and enh.config == enhancer_rt.config
    x = speechlike(3 * 16000, channels=2)
    ref, got = enhancer_rt.enhance(x, 16000), enh.enhance(x, 16000)
    assert got.shape == x.shape
    assert snr_db(ref, got) > MIN_PARITY_SNR_DB
    # streaming in odd chunks (3 frames per call) stays close to the int8 offline path (64 per call):
    # the int8 kernels round activations differently for different row counts (about 65 dB here)
    s = enh.stream(16000, channels=2)
    parts = [s.feed(x[i:i + 777]) for i in range(0, len(x), 777)] + [s.flush()]
    assert snr_db(got, np.concatenate(parts)) > MIN_PARITY_SNR_DB + 20


def test_export_cli_int8_and_bench_flag(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = enhancer.ModelConfig.preset("baseline", attention_window=8)
    ckpt = enhancer.save_checkpoint(enhancer.build_model(cfg).eval(), cfg, tmp_path / "b.pt")
    assert main(["export", str(ckpt), "-o", str(tmp_path / "b.onnx"), "--int8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["weights"] == "int8" and report["parity_snr_db"] >= MIN_PARITY_SNR_DB
    assert main(["info", str(tmp_path / "b.onnx"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weights"] == "int8"
    assert main(["bench", "--int8", "--model", str(tmp_path / "b.onnx")]) == 2
    assert "--int8 applies to --preset" in capsys.readouterr().err


def test_a_graph_without_dense_weights_is_refused():
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    with pytest.raises(ValueError, match="no dense layer"):
        quantize_int8(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
