"""8-bit key/value rings (`enhancer export --int8-rings`): layout, calibration, closeness, errors."""
import json

import numpy as np
import onnx
import pytest
import soundfile as sf

from enhancer.build.export import export_step
from enhancer.build.graph_switch import SWITCH
from enhancer.build.quantize import MIN_PARITY_SNR_DB
from enhancer.build.ringquant import HEADROOM, calibrate_rings, graph_ring_scales, quantize_rings, ring_scales
from enhancer.cli import main
from enhancer.engine import Engine, LanePool
from enhancer.runtime import Enhancer
from enhancer.step_io import ring_views, write_rings
from tests.conftest import speechlike
from tests.tolerance import snr_db


def calibration_audio():
    return [speechlike(2 * 16000, seed=s) * g for s, g in ((1, 1.0), (2, 0.3), (3, 2.0))]


@pytest.fixture(scope="module")
def rings_path(torch_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("rings") / "tim-rings.onnx"
    report = export_step(torch_model, path, ring_calibration=calibration_audio())
    assert report["rings"] == "int8" and report["weights"] == "fp32"
    assert report["parity_snr_db"] >= MIN_PARITY_SNR_DB  # against torch, step by step, rings wrapping
    assert report["max_abs_diff"] > 0  # not exact
    return path


def test_write_rings_transposed_keys_hold_the_same_rows(rng):
    n2, b, h, w, dh = 4, 3, 2, 5, 3
    rows = rng.integers(-128, 128, (2, h, n2 * 7, dh), dtype=np.int8)  # 2 lanes, T = 7 > W: the last 5 kept
    pos, lanes = np.array([3, 11]), np.array([2, 0])
    flat, trans = np.zeros((n2, b, h, w, dh), np.int8), np.zeros((n2, b, h, w, dh), np.int8)
    write_rings(flat, rows, pos, w, lanes)
    write_rings(trans, rows, pos, w, lanes, keys_transposed=True)
    views = ring_views(trans, keys_transposed=True)
    for j in range(n2 // 2):  # keys: (B, H, dh, W) views of the same memory
        assert views[j].shape == (b, h, dh, w) and np.shares_memory(views[j], trans)
        np.testing.assert_array_equal(views[j].transpose(0, 1, 3, 2), flat[j])
    for j in range(n2 // 2, n2):
        np.testing.assert_array_equal(views[j], flat[j])
    # lane 2 got frames 3..9: frame 9 (its last) in slot 9 % 5 = 4, key ring 0, head 1
    r = rows.reshape(2, h, n2, 7, dh)
    np.testing.assert_array_equal(views[0][2, 1, :, 4], r[0, 1, 0, 6])
    assert not flat[:, 1].any()  # lane 1 untouched


def test_ring_scales_have_headroom_and_survive_silent_heads():
    s = ring_scales(np.array([[127.0, 0.0]]))
    np.testing.assert_allclose(s, [[HEADROOM, 1 / 127]], rtol=1e-6)


def test_graph_layout(rings_path, torch_model):
    cfg = torch_model.config
    m = onnx.load(str(rings_path))
    ins = {i.name: i.type.tensor_type for i in m.graph.input}
    dims = lambda t: [d.dim_value for d in t.shape.dim][1:]  # noqa: E731
    for j in range(cfg.n_layers):
        assert ins[f"k{j}"].elem_type == onnx.TensorProto.INT8 == ins[f"v{j}"].elem_type
        assert dims(ins[f"k{j}"]) == [cfg.n_heads, cfg.head_dim, cfg.attention_window]
        assert dims(ins[f"v{j}"]) == [cfg.n_heads, cfg.attention_window, cfg.head_dim]
    out = {o.name: o.type.tensor_type.elem_type for o in m.graph.output}
    assert out["kv_rows"] == onnx.TensorProto.INT8 and out["out"] == onnx.TensorProto.FLOAT
    switch = next(n for n in m.graph.node if n.name == SWITCH)
    live = next(a.g for a in switch.attribute if a.name == "then_branch")
    ops = [n.op_type for n in live.node]
    assert ops.count("MatMulInteger") == 2 * cfg.n_layers
    assert not [n for n in live.node if n.op_type == "MatMul" and set(n.input) & set(ins)]  # no float product reads a ring
    meta = {p.key: p.value for p in m.metadata_props}
    assert meta["tim_enhancer.rings"] == "int8" and float(meta["tim_enhancer.ring_calibration_seconds"]) == 6.0
    with pytest.raises(ValueError, match="not float32"):
        quantize_rings(m, np.ones((2 * cfg.n_layers, cfg.n_heads)))


def test_runtime_stays_close_to_float_rings(rings_path, enhancer_rt):
    enh = Enhancer.from_pretrained(rings_path, providers=["CPUExecutionProvider"])
    assert enh.engine.int8_rings and not enhancer_rt.engine.int8_rings
    x = speechlike(3 * 16000, channels=2, seed=7)  # not the calibration audio
    ref, got = enhancer_rt.enhance(x, 16000), enh.enhance(x, 16000)
    assert got.shape == x.shape and snr_db(ref, got) > MIN_PARITY_SNR_DB
    # live: one 16 ms hop per call, every earlier frame read from the 8-bit rings
    s = enh.stream(16000, channels=2)
    live = np.concatenate([s.feed(x[i:i + 256]) for i in range(0, len(x), 256)] + [s.flush()])
    assert snr_db(ref, live) > MIN_PARITY_SNR_DB and snr_db(got, live) > MIN_PARITY_SNR_DB
    assert np.abs(live - got).max() > 0  # live reads quantized rows the chunked path kept in float


def test_lane_pool_rings_are_a_quarter_of_the_bytes(rings_path, model_path):
    q, f = LanePool(Engine(rings_path), 4), LanePool(Engine(model_path), 4)
    assert q.rings.dtype == np.int8 and q.rings.nbytes * 4 == f.rings.nbytes
    lanes = q.alloc(2)
    q.step(lanes, speechlike(2 * 256).reshape(2, 256), np.zeros(2, np.float32))
    assert q.rings[:, lanes].any()
    q.free(lanes)
    assert not q.rings[:, q.alloc(2)].any()  # a lane taken again starts from zero rings


def test_calibration_errors(model_path, rings_path):
    eng = Engine(model_path)
    amax, seconds = calibrate_rings(eng, calibration_audio()[:1])
    assert amax.shape == (2 * eng.config.n_layers, eng.config.n_heads) and (amax > 0).all() and seconds == 2.0
    with pytest.raises(ValueError, match="at least 1 s"):
        calibrate_rings(eng, [np.zeros(8000, np.float32)])
    with pytest.raises(ValueError, match="float32 rings"):
        calibrate_rings(Engine(rings_path), calibration_audio())
    with pytest.raises(ValueError, match="ring scales of shape"):
        quantize_rings(onnx.load(str(model_path)), np.ones((3, 3)))


def test_export_cli(torch_model, tmp_path, capsys):
    import enhancer

    ckpt = enhancer.save_checkpoint(torch_model, torch_model.config, tmp_path / "m.pt")
    out = str(tmp_path / "m.onnx")
    assert main(["export", str(ckpt), "-o", out, "--int8-rings", "-q"]) == 2
    assert "--int8-rings needs --calibrate" in capsys.readouterr().err
    assert main(["export", str(ckpt), "-o", out, "--calibrate", str(tmp_path), "-q"]) == 2
    assert "--calibrate applies to --int8-rings" in capsys.readouterr().err
    assert main(["export", str(ckpt), "-o", out, "--int8-rings", "--calibrate", str(tmp_path / "none"), "-q"]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    (tmp_path / "cal").mkdir()
    (tmp_path / "cal" / "bad.wav").write_bytes(b"RIFF not audio")
    assert main(["export", str(ckpt), "-o", out, "--int8-rings", "--calibrate", str(tmp_path / "cal"), "-q"]) == 2
    assert "bad.wav: cannot read it as audio" in capsys.readouterr().err
    (tmp_path / "cal" / "bad.wav").unlink()
    sf.write(tmp_path / "cal" / "a.flac", speechlike(48000 * 2, sr=48000), 48000)  # resampled to 16 kHz
    assert main(["export", str(ckpt), "-o", out, "--int8-rings", "--calibrate", str(tmp_path / "cal"), "-q"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rings"] == "int8" and report["parity_snr_db"] >= MIN_PARITY_SNR_DB
    assert main(["info", out, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rings"] == "int8"


def test_export_again_with_the_ring_scales_of_an_earlier_export(torch_model, rings_path, model_path, tmp_path, capsys):
    import enhancer

    ckpt = enhancer.save_checkpoint(torch_model, torch_model.config, tmp_path / "m.pt")
    out = tmp_path / "again.onnx"
    assert main(["export", str(ckpt), "-o", str(out), "--int8-rings", "--ring-scales-from", str(rings_path), "-q"]) == 0
    assert json.loads(capsys.readouterr().out)["rings"] == "int8"
    (old, seconds), (new, again) = graph_ring_scales(rings_path), graph_ring_scales(out)
    assert np.array_equal(new, old) and old.shape == (2 * torch_model.config.n_layers, torch_model.config.n_heads)
    assert again == seconds == f"{sum(len(x) for x in calibration_audio()) / 16000:.1f}"
    x = speechlike(16000, seed=7)  # the same graph again: the same output, bit for bit
    assert np.array_equal(Enhancer(Engine(out)).enhance(x, 16000), Enhancer(Engine(rings_path)).enhance(x, 16000))
    assert main(["export", str(ckpt), "-o", str(out), "--ring-scales-from", str(rings_path), "-q"]) == 2
    assert "--ring-scales-from applies to --int8-rings" in capsys.readouterr().err
    assert main(["export", str(ckpt), "-o", str(out), "--int8-rings", "--ring-scales-from", str(model_path), "-q"]) == 2
    assert "not a step graph with 8-bit key/value rings" in capsys.readouterr().err


def test_an_unknown_ring_format_is_refused(rings_path, tmp_path):
    from enhancer.errors import CheckpointError

    m = onnx.load(str(rings_path))
    for p in m.metadata_props:
        if p.key == "tim_enhancer.rings":
            p.value = "int4"
    onnx.save(m, str(tmp_path / "int4.onnx"))
    with pytest.raises(CheckpointError, match="rings stored as 'int4'"):
        Engine(tmp_path / "int4.onnx")


def test_lanes_stepped_together_match_lanes_stepped_alone(rings_path):
    """A batch of scattered lanes (the gather path of `LanePool.run`) gives each stream what it gets
    alone: the query scales are per stream and head, the ring scales fixed."""
    eng = Engine(rings_path)
    x = np.stack([speechlike(40 * 256, seed=s) * g for s, g in ((4, 1.0), (5, 0.5), (6, 2.0))])  # 3 streams
    hops = x.reshape(3, 40, 256)
    gain = np.zeros(3, np.float32)
    shared = LanePool(eng, 6)
    shared.alloc(6)
    lanes = np.array([0, 2, 5])  # lanes 1, 3 and 4 are in the call's range but not stepped
    together = np.stack([shared.step(lanes, hops[:, t], gain).out for t in range(40)], axis=1)
    assert shared.pos.tolist() == [40, 0, 40, 0, 0, 40] and not shared.rings[:, [1, 3, 4]].any()
    alone = []
    for i in range(3):
        p = LanePool(eng, 1)
        lane = p.alloc(1)
        alone.append(np.stack([p.step(lane, hops[i:i + 1, t], gain[:1]).out[0] for t in range(40)]))
    for i in range(3):
        assert snr_db(alone[i], together[i]) > 60  # 87 dB to exact here: a rounding or two of a query


def test_an_ordinary_transformer_exports_with_8_bit_rings(tmp_path):
    """The baseline preset (no TIM blocks, one mechanism per layer) takes the same rewrite."""
    import torch

    import enhancer

    torch.manual_seed(0)
    cfg = enhancer.ModelConfig.preset("baseline", attention_window=8)
    report = export_step(enhancer.build_model(cfg).eval(), tmp_path / "b.onnx", ring_calibration=calibration_audio()[:1])
    assert report["rings"] == "int8" and report["parity_snr_db"] >= MIN_PARITY_SNR_DB
    assert Engine(tmp_path / "b.onnx").int8_rings


def test_ring_scores_grouped_by_heads_are_exact(model_path, rings_path, tmp_path):
    """The live step's key-ring scores, one 8-bit product per head, per group of heads or per stream
    (block-diagonal queries), are the same integers: the outputs agree bit for bit, rings wrapping."""
    scales, _ = graph_ring_scales(rings_path)
    outs, meta = {}, onnx.load(str(rings_path), load_external_data=False).metadata_props
    for heads in (1, 4, 16):
        path = tmp_path / f"g{heads}.onnx"
        m = quantize_rings(onnx.load(str(model_path)), scales, heads_per_product=heads)
        del m.metadata_props[:]
        m.metadata_props.extend(meta)  # the 8-bit rings' metadata (`export_step` writes it)
        onnx.save(m, str(path))
        live = next(a.g for a in next(n for n in m.graph.node if n.name == SWITCH).attribute if a.name == "then_branch")
        blocks = [n for n in live.node if n.name.endswith("/q_blocks")]
        assert len(blocks) == (0 if heads == 1 else len(scales) // 2)
        pool = LanePool(Engine(path), 3)
        lanes = pool.alloc(3)
        x = speechlike(3 * 256 * 40, seed=5).reshape(3, 40, 256)
        outs[heads] = np.stack([pool.step(lanes, x[:, i], np.zeros(3, np.float32)).out for i in range(40)])
    assert np.abs(outs[4]).max() > 0
    np.testing.assert_array_equal(outs[1], outs[4])
    np.testing.assert_array_equal(outs[16], outs[4])
