"""The upper band's learned head (`enhancer.upperhead`): the numpy GRU equals torch's on the same
weights, frame by frame; broken weight files are a CheckpointError naming the file; a head beside
the model is used (the shipped model has one); with a head a band's gain is the head's, at least
HEAD_FLOOR times the speech probability; a stream with a head is the same in any chunking and the
same as without one at 16 kHz; a head for other inputs is a CheckpointError."""
import numpy as np
import pytest

from enhancer.errors import CheckpointError
from enhancer.upperhead import N_FEATURES, WEIGHTS, UpperHead, features


def random_weights(n_in=N_FEATURES, hidden=8, seed=0) -> dict:
    r = np.random.default_rng(seed)
    return {"inp_w": r.normal(0, 0.5, (hidden, n_in)), "inp_b": r.normal(0, 0.1, hidden),
            "w_ih": r.normal(0, 0.5, (3 * hidden, hidden)), "w_hh": r.normal(0, 0.5, (3 * hidden, hidden)),
            "b_ih": r.normal(0, 0.1, 3 * hidden), "b_hh": r.normal(0, 0.1, 3 * hidden),
            "out_w": r.normal(0, 0.5, (1, hidden)), "out_b": r.normal(0, 0.1, 1)}


def test_the_numpy_head_equals_torch_frame_by_frame():
    torch = pytest.importorskip("torch")
    w = random_weights()
    head = UpperHead(w)
    inp = torch.nn.Linear(N_FEATURES, 8)
    gru = torch.nn.GRU(8, 8, batch_first=True)
    out = torch.nn.Linear(8, 1)
    with torch.no_grad():
        inp.weight[:], inp.bias[:] = torch.tensor(w["inp_w"]), torch.tensor(w["inp_b"])
        gru.weight_ih_l0[:], gru.weight_hh_l0[:] = torch.tensor(w["w_ih"]), torch.tensor(w["w_hh"])
        gru.bias_ih_l0[:], gru.bias_hh_l0[:] = torch.tensor(w["b_ih"]), torch.tensor(w["b_hh"])
        out.weight[:], out.bias[:] = torch.tensor(w["out_w"]), torch.tensor(w["out_b"])
        x = np.random.default_rng(1).normal(0, 1, (5, 40, N_FEATURES)).astype(np.float32)  # (bands, frames, features)
        h_t, _ = gru(torch.relu(inp(torch.tensor(x))))
        want = torch.sigmoid(out(h_t))[..., 0].numpy()
    h = head.state((5,))
    got = []
    for t in range(40):
        g, h = head.step(x[:, t], h)
        got.append(g)
    got = np.stack(got, 1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_features_have_the_heads_width_and_stay_finite_on_silence():
    c, k = 2, 8
    zeros = np.zeros((c, k))
    x = features(zeros, zeros, np.zeros(c), np.zeros((c, 5)), np.zeros((c, 5)), np.zeros((c, 5)),
                 np.linspace(8500, 22000, k))
    assert x.shape == (c, k, N_FEATURES) and np.all(np.isfinite(x))


def test_broken_weights_are_a_checkpoint_error(tmp_path):
    w = random_weights()
    del w["w_hh"]
    np.savez(tmp_path / "a.npz", **w)
    with pytest.raises(CheckpointError, match="w_hh"):
        UpperHead.load(tmp_path / "a.npz")
    w = random_weights()
    w["w_ih"] = w["w_ih"][:5]
    np.savez(tmp_path / "b.npz", **w)
    with pytest.raises(CheckpointError, match="shapes"):
        UpperHead.load(tmp_path / "b.npz")
    np.savez(tmp_path / "d.npz", **random_weights(n_in=N_FEATURES - 3))  # a head for other inputs
    with pytest.raises(CheckpointError, match=f"reads {N_FEATURES - 3} inputs"):
        UpperHead.load(tmp_path / "d.npz")
    (tmp_path / "c.npz").write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="c.npz"):
        UpperHead.load(tmp_path / "c.npz")


def test_a_head_beside_the_model_is_used_and_one_ships(tmp_path):
    from enhancer.engine import load_upper_head
    from enhancer.runtime import MODELS_DIR

    shipped = load_upper_head(MODELS_DIR / "tim.onnx")
    assert shipped is not None and shipped.hidden == 48
    assert load_upper_head(tmp_path / "model.onnx") is None
    np.savez(tmp_path / WEIGHTS, **random_weights(hidden=4))
    assert load_upper_head(tmp_path / "model.onnx").hidden == 4


class _ConstantHead:
    """A head whose gain is `value` in every band and frame."""

    hidden = 1

    def __init__(self, value):
        self.value = value

    def state(self, shape):
        return np.zeros(shape + (1,), np.float32)

    def step(self, x, h):
        return np.full(x.shape[:-1], self.value), h


@pytest.mark.parametrize("value", [0.0, 0.6])
def test_with_a_head_the_gain_is_the_heads_at_least_the_floor_times_the_speech_probability(value):
    from enhancer.fullband import HEAD_FLOOR, BandGains

    sr, hop = 48000, 480
    f = np.fft.rfftfreq(2 * hop, 1 / sr)
    g = BandGains(sr, 2 * hop, hop, 2, _ConstantHead(value))
    rng = np.random.default_rng(0)
    low = [rng.exponential(1e-6, (2, len(f))) for _ in range(3)]
    upper = f >= 8000
    for speech in (0.0, 0.5, 1.0, 0.25):
        gains = g.step(rng.exponential(1e-6, (2, len(f))), np.array([speech, 1.0]), low)
        np.testing.assert_allclose(gains[0, upper], max(value, HEAD_FLOOR * speech), rtol=1e-12)
        np.testing.assert_allclose(gains[1, upper], max(value, HEAD_FLOOR), rtol=1e-12)
        assert np.all(gains[:, ~upper] == 0.0)  # the model's band is not added again


def test_a_stream_with_a_head_is_chunking_free(enhancer_rt):
    from tests.enhancer.test_fullband import chunked, noisy
    from tests.tolerance import assert_close_to_peak

    engine = enhancer_rt.engine
    kept = engine.upper_head
    sr = 48000
    x = noisy(sr, 2.0, seed=4)
    try:
        engine.upper_head = None
        wiener = enhancer_rt.enhance(x, sr)
        engine.upper_head = UpperHead(random_weights(hidden=8, seed=2))
        whole = enhancer_rt.enhance(x, sr)
        parts = chunked(enhancer_rt.stream(sr, 1), x, np.random.default_rng(5), 3000)
        x16 = noisy(16000, 1.0, seed=4)
        at16 = enhancer_rt.enhance(x16, 16000)
        engine.upper_head = None
        assert np.array_equal(at16, enhancer_rt.enhance(x16, 16000))  # no upper band at 16 kHz
    finally:
        engine.upper_head = kept
    assert_close_to_peak(parts, whole, rel=1e-5)
    assert not np.allclose(whole, wiener)  # the head takes part
