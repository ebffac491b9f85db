"""`enhancer-train average`: the averaged checkpoint holds the weighted mean of its inputs, loads and
runs like any other, and inputs that cannot be averaged are refused with the reason."""
from __future__ import annotations

import pytest
import torch

from enhancer import ModelConfig, build_model, load_checkpoint, save_checkpoint
from tests.training.conftest import TINY_MODEL
from training.average import average_checkpoints
from training.cli import main
from training.data.manifests import DataError


def tiny_config(**over) -> ModelConfig:
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in TINY_MODEL.items() if k != "preset"}
    kw.update(over)
    return ModelConfig.preset(TINY_MODEL["preset"], **kw)


def checkpoint(tmp_path, name, seed, cfg=None, mean=None):
    cfg = cfg or tiny_config()
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        model.feat_mean.copy_(torch.linspace(-3, 1, model.feat_mean.numel()).reshape(model.feat_mean.shape)
                              if mean is None else mean)
    return save_checkpoint(model, cfg, tmp_path / name), model


def test_weighted_mean_of_every_float_tensor(tmp_path):
    a_path, a = checkpoint(tmp_path, "a.pt", 1)
    b_path, b = checkpoint(tmp_path, "b.pt", 2)
    out = average_checkpoints([a_path, b_path], tmp_path / "ab.pt", weights=[3, 1])
    avg = load_checkpoint(out)
    sa, sb, s = a.state_dict(), b.state_dict(), avg.state_dict()
    differing = 0
    for k, v in s.items():
        if v.is_floating_point():
            want = 0.75 * sa[k].double() + 0.25 * sb[k].double()
            torch.testing.assert_close(v.double(), want, rtol=1e-6, atol=1e-6 * float(want.abs().max()) + 1e-30)
            differing += int(not torch.equal(sa[k], sb[k]))
    assert differing > 10  # the two inputs really differ, so the check above means something
    assert [x["weight"] for x in avg.checkpoint["extra"]["averaged"]] == [0.75, 0.25]
    # the soup of a checkpoint with itself is that checkpoint
    same = load_checkpoint(average_checkpoints([a_path, a_path], tmp_path / "aa.pt"))
    for k, v in same.state_dict().items():
        torch.testing.assert_close(v, sa[k], rtol=1e-6, atol=0)
    # and it runs
    wav = 0.1 * torch.randn(1, 4000, generator=torch.Generator().manual_seed(0))
    y = avg.enhance(wav)
    assert y.shape == wav.shape and torch.isfinite(y).all()


def test_cli_writes_a_loadable_half_checkpoint(tmp_path, capsys):
    a_path, _ = checkpoint(tmp_path, "a.pt", 1)
    b_path, _ = checkpoint(tmp_path, "b.pt", 2)
    assert main(["average", str(a_path), str(b_path), "-o", str(tmp_path / "s.pt"), "--half"]) == 0
    blob = torch.load(tmp_path / "s.pt", map_location="cpu", weights_only=True)
    assert all(v.dtype == torch.float16 for v in blob["state_dict"].values() if v.is_floating_point())
    assert "averaged 2 checkpoints" in capsys.readouterr().out


def test_refuses_what_cannot_be_averaged(tmp_path, capsys):
    a_path, a = checkpoint(tmp_path, "a.pt", 1)
    other_arch, _ = checkpoint(tmp_path, "wide.pt", 2, cfg=tiny_config(d_ffn=96))
    other_norm, _ = checkpoint(tmp_path, "norm.pt", 3, mean=torch.zeros_like(a.feat_mean))
    with pytest.raises(DataError, match="config differs"):
        average_checkpoints([a_path, other_arch], tmp_path / "x.pt")
    with pytest.raises(DataError, match="normalisation"):
        average_checkpoints([a_path, other_norm], tmp_path / "x.pt")
    with pytest.raises(DataError, match="at least two"):
        average_checkpoints([a_path], tmp_path / "x.pt")
    with pytest.raises(DataError, match="1 weight"):
        average_checkpoints([a_path, a_path], tmp_path / "x.pt", weights=[1])
    assert main(["average", str(a_path), str(tmp_path / "missing.pt"), "-o", str(tmp_path / "x.pt")]) == 2
    assert "missing.pt" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()
