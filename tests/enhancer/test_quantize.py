"""8-bit dense layers (`enhancer export --int8`): what is quantized and how, how close the output stays, errors."""
import json

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

import enhancer
from enhancer.build.export import export_step
from enhancer.build.graph_switch import all_nodes
from enhancer.build.quantize import MIN_PARITY_SNR_DB, ROW_INT8_MIN_WEIGHTS, quantize_int8
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


def _row_int8_layers(nodes, inits):
    return [n for n in nodes if n.op_type == "MatMulIntegerToFloat" and n.input[1].endswith("__i8") and n.input[1] in inits]


def test_dense_weights_become_8bit_and_the_dft_stays_float(int8_path, model_path):
    q, f = onnx.load(str(int8_path)), onnx.load(str(model_path))
    q_nodes, f_nodes = list(all_nodes(q.graph)), list(all_nodes(f.graph))  # both branches of the frames switch
    ops = [n.op_type for n in q_nodes]
    inits = {i.name: numpy_helper.to_array(i) for i in q.graph.initializer}
    # every Gemm (pre-encoder convolutions, projections, ordinary blocks, inter-mechanism attention, head):
    # the large ones on MatMulIntegerToFloat with row-quantized inputs, the others as MatMulNBits blocks
    n_gemm = sum(n.op_type == "Gemm" for n in f_nodes)
    rows, blocks = _row_int8_layers(q_nodes, inits), [n for n in q_nodes if n.op_type == "MatMulNBits"]
    assert "Gemm" not in ops and len(rows) + len(blocks) == n_gemm > 20 and rows and blocks
    for n in rows:
        w = inits[n.input[1]]
        assert w.dtype == np.int8 and w.size >= ROW_INT8_MIN_WEIGHTS and np.abs(w).max() == 127
        assert inits[n.input[1] + "_scale"].shape == (w.shape[1],)
    assert inits["fwd_basis"].dtype == np.float32 and inits["inv_basis"].dtype == np.float32
    mm_out, large = set(), []
    for n in blocks:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["bits"] == 8 and attrs["block_size"] == 32 and inits[n.input[1]].dtype == np.uint8
        if attrs["K"] * attrs["N"] >= ROW_INT8_MIN_WEIGHTS:
            large.append(attrs["K"])
        mm_out.add(n.output[0])
    # of the large layers only the first of each body stays on blocks: the pre-encoder's first
    # convolution, which reads the log-magnitude features of three frames
    meta = {p.key: p.value for p in q.metadata_props}
    cfg = json.loads(meta["tim_enhancer.config"])
    assert large == [cfg["kernel_size"] * (cfg["stft"]["n_fft"] // 2 + 1)] * 2
    # biases are folded into MatMulNBits: no Add of a constant follows one
    assert not [n for n in q_nodes if n.op_type == "Add" and set(n.input) & mm_out and set(n.input) & set(inits)]
    assert sum(len(n.input) == 6 for n in blocks) >= len(blocks) // 2
    assert meta["tim_enhancer.weights"] == "int8"
    assert int8_path.stat().st_size < 0.7 * model_path.stat().st_size


def _dense_graph(w, b):
    from onnx import TensorProto, helper

    k, n = w.shape
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="dense")], "g", [x], [y],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # what onnxruntime reads
    return model


def test_a_row_quantized_layer_computes_what_its_8bit_arithmetic_says(rng):
    """One dense layer above the threshold: the graph's output equals the same 8-bit arithmetic done
    in numpy (each row's own scale and two codes, per-column weight scales), and stays within the
    8-bit weights' precision of the float product; a row's output does not depend on the other rows
    (a loud stream beside it); the first dense layer of a graph stays on blocks unless asked."""
    import onnxruntime as ort

    k, n = 384, 256
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    b = (rng.standard_normal(n) * 0.1).astype(np.float32)
    q = quantize_int8(_dense_graph(w, b), keep_first=False)
    assert [node.op_type for node in q.graph.node].count("MatMulIntegerToFloat") == 1 and k * n >= ROW_INT8_MIN_WEIGHTS
    sess = ort.InferenceSession(q.SerializeToString(), providers=["CPUExecutionProvider"])
    x = (rng.standard_normal((3, k)) * np.array([[1.0], [0.01], [300.0]])).astype(np.float32)
    got = sess.run(None, {"x": x})[0]

    sx = np.abs(x).max(1, keepdims=True) * np.float32(1.0 / 127.0)  # float32, as the graph computes it
    xn = x / sx
    q1 = np.round(xn)  # the first code, and the rounding error's, at 1/254 of its step
    q2 = np.round((xn - q1) / np.float32(1.0 / 254.0))
    assert np.abs(q1).max() == 127 and np.abs(q2).max() <= 127
    sw = np.abs(w.astype(np.float64)).max(0) / 127.0  # the export's float64 weight scales
    wq = np.round(w / sw)
    expect = (q1 @ wq + (q2 @ wq) / 254.0) * sw.astype(np.float32) * sx + b
    row_peak = np.abs(expect).max(1, keepdims=True)  # tolerances at each row's own level
    assert np.all(np.abs(got - expect) <= 1e-5 * (np.abs(expect) + row_peak))
    for row in range(3):  # each row within the 8-bit weights' precision of the float product, at its own level
        assert snr_db(x[row] @ w + b, got[row]) > 40.0
        alone = sess.run(None, {"x": x[row:row + 1]})[0][0]
        np.testing.assert_array_equal(alone, got[row])
    assert [node.op_type for node in quantize_int8(_dense_graph(w, b)).graph.node] == ["MatMulNBits"]


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
