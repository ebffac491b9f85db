"""Model: causality, parameter budget, grouped layers, competition, config, checkpoints."""
import dataclasses

import pytest
import torch

import enhancer
from enhancer import ModelConfig
from enhancer.build.model import count_parameters
from enhancer.build.model.layers import SOFTMAX_FLOOR, GroupedLinear, masked_softmax, window_mask
from enhancer.errors import CheckpointError


@pytest.mark.parametrize("preset", ModelConfig.presets())
def test_causality_every_preset(preset):
    """Output frame t is bit-identical when only input frames later than t + lookahead change."""
    torch.manual_seed(0)
    cfg = ModelConfig.preset(preset, attention_window=12)
    model = enhancer.build_model(cfg).eval()
    t_len, t = 30, 17
    x = torch.randn(1, t_len, cfg.n_freqs) - 4.0
    y = x.clone()
    y[:, t + cfg.lookahead + 1:] += torch.randn(1, t_len - t - cfg.lookahead - 1, cfg.n_freqs)
    with torch.no_grad():
        gx, _ = model(x)
        gy, _ = model(y)
    assert torch.equal(gx[:, : t + 1], gy[:, : t + 1])
    # and the lookahead is really used: changing frame t + lookahead changes frame t
    z = x.clone()
    z[:, t + cfg.lookahead] += 1.0
    with torch.no_grad():
        gz, _ = model(z)
    assert not torch.equal(gx[:, t], gz[:, t])
    assert torch.equal(gx[:, :t], gz[:, :t])


def test_attention_window_limits_the_past():
    """With no conv context left, a frame further back than the window has no influence."""
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tim", attention_window=4)
    model = enhancer.build_model(cfg).eval()
    x = torch.randn(1, 40, cfg.n_freqs)
    y = x.clone()
    y[:, 5] += 3.0
    with torch.no_grad():
        gx, _ = model(x)
        gy, _ = model(y)
    # frame 5 reaches conv outputs up to step 5 + 8 (4 layers x 2 frames), attention reaches W-1 further per
    # layer (8 layers), and the output is read L steps later: beyond that nothing can change
    horizon = 5 + 8 + 8 * (cfg.attention_window - 1) - cfg.lookahead
    assert not torch.equal(gx[:, 5], gy[:, 5])
    assert torch.equal(gx[:, horizon + 1:], gy[:, horizon + 1:])


def test_tim_and_baseline_sizes_match_within_5_percent():
    n_tim = count_parameters(enhancer.build_model("tim"))
    n_base = count_parameters(enhancer.build_model("baseline"))
    assert abs(n_tim - n_base) / n_base < 0.05
    assert 6.0e6 < n_base < 8.0e6  # near the paper's budget (~6 M) with its pre-encoder (2.66 M)


def test_tim_layers_layout():
    cfg = ModelConfig.preset("tim")
    assert [cfg.is_tim_layer(i) for i in range(8)] == [False, False, True, True, True, True, True, False]
    assert ModelConfig.preset("baseline").n_tim_layers == 0


def test_grouped_linear_equals_block_diagonal_dense():
    torch.manual_seed(0)
    gl = GroupedLinear(3, 5, 7)
    x = torch.randn(2, 4, 3, 5)
    dense = x.reshape(2, 4, 15) @ gl.dense_weight() + gl.bias.reshape(-1)
    torch.testing.assert_close(gl(x).reshape(2, 4, 21), dense)
    # the one-frame path (B, G, d_in) gives the same numbers
    torch.testing.assert_close(gl(x[:, 0]), gl(x)[:, 0])


def test_grouped_linear_rejects_wrong_shape():
    with pytest.raises(ValueError, match=r"expects \(\.\.\., 3, 5\)"):
        GroupedLinear(3, 5, 7)(torch.randn(2, 4, 15))


@pytest.mark.parametrize("preset, n_s", [("tim", 2), ("tim4", 4)])
def test_competition_sums_to_one(preset, n_s):
    torch.manual_seed(0)
    cfg = ModelConfig.preset(preset, attention_window=8)
    model = enhancer.build_model(cfg).eval()
    with torch.no_grad():
        gains, comp = model(torch.randn(2, 20, cfg.n_freqs))
    assert comp.shape == (2, 20, 5, n_s)
    torch.testing.assert_close(comp.sum(-1), torch.ones(2, 20, 5))
    assert (comp > 0).all() and (gains > 0).all() and (gains < 1).all()


def test_nocomp_and_baseline_have_no_competition():
    for preset in ("tim-nocomp", "baseline"):
        cfg = ModelConfig.preset(preset, attention_window=8)
        _, comp = enhancer.build_model(cfg).eval()(torch.randn(1, 10, cfg.n_freqs))
        assert comp is None


def test_window_mask():
    m = window_mask(5, 2)
    assert m.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [False, True, True, False, False],
        [False, False, True, True, False],
        [False, False, False, True, True],
    ]


def test_masked_softmax_is_the_softmax_of_masked_scores():
    """Scores far below their row's largest enter the step's softmax at SOFTMAX_FLOOR below it:
    masked (-inf) entries weigh under exp(-SOFTMAX_FLOOR) of the largest, the rest as in softmax."""
    g = torch.Generator().manual_seed(0)
    x = 8 * torch.randn(64, 257, generator=g, dtype=torch.float64)
    keep = torch.rand(64, 257, generator=g) < 0.3
    keep[:, -1] = True  # every row attends at least one key, as every frame attends itself
    scores = x.masked_fill(~keep, float("-inf"))
    ref, got = torch.softmax(scores, dim=-1), masked_softmax(scores)
    assert torch.allclose(got[keep], ref[keep], rtol=1e-12, atol=0)  # masked entries add < 1e-32 to a row's sum
    floor = torch.exp(torch.tensor(-SOFTMAX_FLOOR, dtype=torch.float64))
    assert (got[~keep] > 0).all() and (got[~keep] <= floor).all()
    far = x.clone()
    far[:, 0] = far.amax(dim=-1) - 200  # a real score far below its row's largest: lifted to the floor
    lifted = masked_softmax(far)
    assert torch.allclose(lifted[:, 1:], torch.softmax(far, dim=-1)[:, 1:], rtol=1e-12, atol=0)
    assert (lifted[:, 0] <= floor).all()


def test_config_round_trip_and_validation():
    cfg = ModelConfig.preset("tim4")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown preset"):
        ModelConfig.preset("huge")
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig.preset("tim", n_mechanisms=3)
    with pytest.raises(ValueError, match="lookahead"):
        ModelConfig.preset("tim", lookahead=9)
    with pytest.raises(ValueError, match="unknown ModelConfig fields: bogus"):
        ModelConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_latency_figures():
    assert ModelConfig.preset("tim").algorithmic_latency_ms == 64.0
    assert ModelConfig.preset("tim-lowlatency").algorithmic_latency_ms == 32.0
    assert ModelConfig.preset("tim").delay_samples == 768


def test_checkpoint_round_trip(tmp_path, torch_model):
    path = enhancer.save_checkpoint(torch_model, torch_model.config, tmp_path / "m.pt", step=7)
    loaded = enhancer.load_checkpoint(path)
    assert loaded.config == torch_model.config
    assert loaded.checkpoint["extra"] == {"step": 7}
    assert set(loaded.checkpoint["versions"]) >= {"torch", "enhancer", "numpy", "python"}
    x = torch.randn(1, 20, 257) - 4
    with torch.no_grad():
        torch.testing.assert_close(loaded(x)[0], torch_model(x)[0], rtol=0, atol=0)
    torch.testing.assert_close(loaded.feat_std, torch_model.feat_std)
    assert not list(tmp_path.glob("*.tmp"))  # atomic write leaves no temporary file


def test_checkpoint_with_mismatching_config(tmp_path, torch_model):
    path = enhancer.save_checkpoint(torch_model, torch_model.config, tmp_path / "m.pt")
    with pytest.raises(CheckpointError, match="differs from the requested one in: attention_window"):
        enhancer.load_checkpoint(path, config=ModelConfig.preset("tim"))
    # weights that do not fit the stored config
    blob = torch.load(path, weights_only=True)
    blob["config"]["d_ffn"] = 1024
    torch.save(blob, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="weights do not match the stored config"):
        enhancer.load_checkpoint(tmp_path / "bad.pt")


def test_config_is_stored_under_the_name_older_runtimes_read(tmp_path, torch_model):
    """The field `attention_window` is stored as `window`, as before it was renamed, so checkpoints,
    exported models and run folders keep their format (the shipped model's metadata is one,
    test_golden); --config files may use either name, not both."""
    cfg = torch_model.config
    old = cfg.to_dict()
    assert "attention_window" not in old and old["window"] == cfg.attention_window
    assert ModelConfig.from_dict(old) == cfg
    renamed = {("attention_window" if k == "window" else k): v for k, v in old.items()}
    assert ModelConfig.from_dict(renamed) == cfg
    assert ModelConfig.preset("tim", window=16) == ModelConfig.preset("tim", attention_window=16)
    with pytest.raises(ValueError, match="not both"):
        ModelConfig.from_dict(old | {"attention_window": 16})
    path = enhancer.save_checkpoint(torch_model, cfg, tmp_path / "m.pt")
    blob = torch.load(path, weights_only=True)
    blob["config"] = old
    torch.save(blob, tmp_path / "old.pt")
    assert enhancer.load_checkpoint(tmp_path / "old.pt").config == cfg


def test_corrupt_or_foreign_checkpoint(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        enhancer.load_checkpoint(tmp_path / "junk.pt")
    torch.save({"weights": torch.zeros(1)}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="not a tim-enhancer checkpoint"):
        enhancer.load_checkpoint(tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="not found"):
        enhancer.load_checkpoint(tmp_path / "missing.pt")


def test_save_refuses_a_config_that_is_not_the_models(tmp_path, torch_model):
    other = dataclasses.replace(torch_model.config, attention_window=99)
    with pytest.raises(CheckpointError, match="different config"):
        enhancer.save_checkpoint(torch_model, other, tmp_path / "x.pt")
