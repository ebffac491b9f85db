"""Multi-frame calls of the step graph (T frames per call, files and backlogs) == one frame per call
(live), for every chunking, on inputs longer than the attention window; float32, fp16-stored and
int8 weights."""
import numpy as np
import pytest
import torch

from enhancer.build.export import export_step, round_to_fp16
from enhancer.build.quantize import MIN_PARITY_SNR_DB
from enhancer.runtime import Enhancer, LanePool
from tests.conftest import SHORT_WINDOW, speechlike
from tests.enhancer.test_streaming import torch_streaming

SECONDS = 1.5  # 94 frames: several times the test models' attention window (16 frames)
CHUNKINGS = [(1,), (2,), (7,), (SHORT_WINDOW,), (SHORT_WINDOW + 9,), (64,), (256,), (1, 40, 3, 17, 2)]


def snr_db(ref: np.ndarray, x: np.ndarray) -> float:
    """Level of `ref` over the level of the difference, in dB (inf when identical)."""
    d = ((ref.astype(np.float64) - x) ** 2).sum()
    return float("inf") if d == 0 else float(10 * np.log10((ref.astype(np.float64) ** 2).sum() / d))


def live(enh: Enhancer, x: np.ndarray, channels: int = 1) -> np.ndarray:
    """One hop per graph call, as a live stream (the reference of the multi-frame paths)."""
    s = enh.stream(16000, channels)
    s.frames_per_call = 1
    return np.concatenate([s.feed(x), s.flush()])


def chunked(enh: Enhancer, x: np.ndarray, frames: int, channels: int = 1) -> np.ndarray:
    s = enh.stream(16000, channels)
    s.frames_per_call = frames
    return np.concatenate([s.feed(x), s.flush()])


@pytest.mark.parametrize("chunks", CHUNKINGS, ids=lambda c: "-".join(map(str, c)))
def test_torch_multi_frame_step_equals_offline_model(torch_model, chunks):
    x = speechlike(int(SECONDS * 16000), seed=3)
    offline = torch_model.enhance(torch.from_numpy(x)[None])[0].numpy()
    got = torch_streaming(torch_model, x, chunks)
    assert got.shape == x.shape
    assert np.abs(got - offline).max() <= 1e-4 * np.abs(offline).max()


@pytest.mark.parametrize("frames", [2, 5, SHORT_WINDOW, SHORT_WINDOW + 1, 40, 256])
def test_runtime_any_frames_per_call_equals_live_steps(enhancer_rt, frames):
    x = speechlike(int(SECONDS * 16000), seed=6)
    assert len(x) > 4 * SHORT_WINDOW * 256
    ref = live(enhancer_rt, x)
    got = chunked(enhancer_rt, x, frames)
    assert got.shape == ref.shape == x.shape
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_enhance_runs_multi_frame_calls_and_matches_live_steps(enhancer_rt, monkeypatch):
    x = speechlike(int(2.5 * 16000), seed=9, channels=2)
    calls = []
    run = LanePool.run
    monkeypatch.setattr(LanePool, "run", lambda self, lanes, hops, g: calls.append(hops.shape[1]) or run(self, lanes, hops, g))
    got = enhancer_rt.enhance(x, 16000, chunk_seconds=1.0)
    assert got.shape == x.shape
    assert max(calls) > SHORT_WINDOW and sum(calls) == -(-(len(x) + enhancer_rt.delay_samples) // 256)
    monkeypatch.undo()
    ref = live(enhancer_rt, x, channels=2)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_backlog_in_one_call_equals_hop_by_hop(enhancer_rt):
    """The cursor API for a stream that fell behind: take_hops(k) -> LanePool.run -> put_outputs,
    with per-hop metadata, gives what k live steps give."""
    pool = LanePool(enhancer_rt.engine, 4)
    a = enhancer_rt.stream(16000, 2, metadata=True, pool=pool)
    b = enhancer_rt.stream(16000, 2, metadata=True, pool=pool)
    ca, cb = a.cursor, b.cursor
    x = speechlike(40 * 256, seed=4, channels=2)
    ca.push(x)
    cb.push(x)
    g = np.zeros(2, np.float32)
    while ca.ready_hops():
        r = pool.step(a.lanes, ca.take_hop(), g)
        ca.put_output(r.out, r.competition, r.activity)
    backlog = cb.ready_hops()
    assert backlog == 40
    r = pool.run(b.lanes, cb.take_hops(backlog), g)
    assert r.out.shape == (2, backlog, 256) and r.activity.shape == (2, backlog)
    cb.put_outputs(r.out, r.competition, r.activity)
    assert cb.ready_hops() == 0 and pool.pos[b.lanes].tolist() == [backlog] * 2
    ya, yb = ca.pull(), cb.pull()
    assert yb.shape == ya.shape
    assert np.abs(yb - ya).max() <= 1e-4 * np.abs(ya).max()
    ma, mb = a.metadata.pop(), b.metadata.pop()
    assert len(ma) == len(mb) == backlog
    for fa, fb in zip(ma, mb):
        assert fb.competition.shape == fa.competition.shape == (2, 5, 2)
        np.testing.assert_allclose(fb.activity, fa.activity, rtol=1e-4)
    # the streams go on hop by hop from where the backlog left them
    tail = speechlike(5000, seed=5, channels=2)
    np.testing.assert_allclose(np.concatenate([b.feed(tail), b.flush()]), np.concatenate([a.feed(tail), a.flush()]),
                               atol=1e-4 * np.abs(ya).max())
    with pytest.raises(ValueError, match="hop"):
        ca.take_hops(1)


def test_fp16_weights_multi_frame_equals_live_and_torch(torch_model, tmp_path):
    import copy

    model = round_to_fp16(copy.deepcopy(torch_model))
    report = export_step(model, tmp_path / "fp16.onnx", fp16_weights=True, n_check_steps=60)
    assert report["weights"] == "fp16" and report["parity_snr_db"] > 100
    enh = Enhancer.from_pretrained(tmp_path / "fp16.onnx", providers=["CPUExecutionProvider"])
    x = speechlike(int(SECONDS * 16000), seed=7)
    ref = model.enhance(torch.from_numpy(x)[None])[0].numpy()
    for got in (live(enh, x), chunked(enh, x, 64), enh.enhance(x, 16000)):
        assert got.shape == x.shape
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_int8_weights_multi_frame_equals_live(torch_model, tmp_path):
    report = export_step(torch_model, tmp_path / "int8.onnx", int8_weights=True, n_check_steps=60)
    assert report["parity_snr_db"] >= MIN_PARITY_SNR_DB  # against torch, in calls of 1 to 64 frames
    enh = Enhancer.from_pretrained(tmp_path / "int8.onnx", providers=["CPUExecutionProvider"])
    x = speechlike(int(SECONDS * 16000), seed=8)
    ref = live(enh, x)
    for frames in (5, SHORT_WINDOW + 9, 64):
        got = chunked(enh, x, frames)
        assert got.shape == x.shape
        assert snr_db(ref, got) >= MIN_PARITY_SNR_DB + 20, frames
