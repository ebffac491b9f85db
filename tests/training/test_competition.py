"""`enhancer-train competition`: speech activity, correlation, entropy and the end-to-end command."""
from __future__ import annotations

import json
import math

import matplotlib.image as mpimg
import numpy as np
import soundfile as sf

from tests.conftest import speechlike
from tests.training.conftest import TINY_MODEL
from training.cli import main
from training.evaluation.competition import (
    SPECIALISATION_R,
    Clip,
    analyse,
    entropy_bits,
    pearson,
    speech_activity,
)

HOP = 256


def test_pearson_matches_numpy_corrcoef():
    r = np.random.default_rng(0)
    a = r.standard_normal(500)
    b = 0.4 * a + r.standard_normal(500)
    assert math.isclose(pearson(a, b), np.corrcoef(a, b)[0, 1], abs_tol=1e-12)
    act = (r.random(500) > 0.6).astype(float)  # point-biserial: a 0/1 series
    s = 0.5 + 0.3 * act + 0.1 * r.standard_normal(500)
    assert math.isclose(pearson(s, act), np.corrcoef(s, act)[0, 1], abs_tol=1e-12)
    assert math.isnan(pearson(a, np.ones(500)))


def test_entropy_of_uniform_and_one_hot_scores():
    for n_s in (2, 4):
        assert np.allclose(entropy_bits(np.full((7, 5, n_s), 1.0 / n_s)), math.log2(n_s))
        one_hot = np.zeros((7, 5, n_s))
        one_hot[..., 1] = 1.0
        assert np.array_equal(entropy_bits(one_hot), np.zeros((7, 5)))
    assert math.isclose(float(entropy_bits(np.array([0.9, 0.1]))),
                        -(0.9 * math.log2(0.9) + 0.1 * math.log2(0.1)))


def test_speech_activity_marks_the_tone_burst_frames():
    start, stop, n = 40 * HOP, 100 * HOP, 160 * HOP  # silence, 0.96 s tone, silence
    x = np.zeros(n, dtype=np.float32)
    t = np.arange(stop - start) / 16000
    x[start:stop] = 0.3 * np.sin(2 * np.pi * 440 * t)
    act = speech_activity(x)
    assert act.shape == (n // HOP + 1,)
    frames = np.flatnonzero(act)
    # frame f is centred on sample f * hop and spans (f - 1) * hop .. (f + 1) * hop
    assert abs(frames[0] - start // HOP) <= 1 and abs(frames[-1] - stop // HOP) <= 1
    assert np.array_equal(frames, np.arange(frames[0], frames[-1] + 1))  # one run, no gaps
    # 30 dB of background noise below the tone stays silent; a clip of digital silence has no speech
    y = x + 0.003 * np.random.default_rng(0).standard_normal(n).astype(np.float32)
    assert np.array_equal(speech_activity(y)[2:-2], act[2:-2])
    assert not speech_activity(np.zeros(n, dtype=np.float32)).any()


def test_analyse_finds_a_specialised_layer_and_falling_entropy():
    r = np.random.default_rng(1)
    clips = []
    for i in range(3):
        act = np.zeros(200, bool)
        act[50 + 10 * i:150] = True
        comp = np.empty((200, 3, 2))
        for j, sharp in enumerate((0.0, 0.25, 0.45)):  # layer 3: confident, mechanism 2 follows speech
            p = 0.5 + sharp * np.where(act, 1.0, -1.0) + 0.02 * r.standard_normal(200)
            comp[:, j, 1] = p
            comp[:, j, 0] = 1 - p
        clips.append(Clip(f"c{i}", act, comp))
    res = analyse(clips)
    assert [L["speech_mechanism"] for L in res["layers"][1:]] == [2, 2]
    assert abs(res["layers"][0]["speech_r"]) < SPECIALISATION_R < res["layers"][2]["speech_r"]
    assert res["specialised"] and res["specialised_layers"] == [2, 3]
    assert res["confidence_grows_with_depth"] and res["entropy_slope_bits_per_layer"] < 0
    assert res["entropy_spearman"] == -1.0
    assert res["layers"][0]["entropy_bits"] > 0.99
    assert "specialise on speech" in res["summary"][0] and "layer(s) 2, 3" in res["summary"][0]


def _pairs(root, n=2):
    for d in ("noisy", "clean"):
        (root / d).mkdir(parents=True)
    for i in range(n):
        clean = speechlike(16000 + 4000 * i, seed=10 + i)
        noise = 0.02 * np.random.default_rng(i).standard_normal(len(clean)).astype(np.float32)
        sf.write(str(root / "clean" / f"f{i}.wav"), clean, 16000)
        sf.write(str(root / "noisy" / f"f{i}.wav"), clean + noise, 16000)
    return root / "noisy", root / "clean"


def test_competition_cli_end_to_end(tiny_ckpt, tiny_model, tmp_path, capsys):
    noisy, clean = _pairs(tmp_path)
    out = tmp_path / "report"
    assert main(["competition", "--model", str(tiny_ckpt), "--noisy", str(noisy), "--clean", str(clean),
                 "--out", str(out)]) == 0
    assert "| TIM layer | speech mechanism |" in capsys.readouterr().out
    res = json.loads((out / "competition.json").read_text())
    assert {"model", "files", "frames", "n_tim", "n_s", "max_entropy_bits", "speech_fraction", "thresholds",
            "layers", "specialised", "specialised_layers", "entropy_slope_bits_per_layer", "entropy_spearman",
            "confidence_grows_with_depth", "example", "summary"} <= set(res)
    cfg = tiny_model.config
    assert res["files"] == 2 and res["n_tim"] == cfg.n_tim_layers == 5 and res["n_s"] == cfg.n_mechanisms == 2
    assert res["frames"] == sum(-(-n // HOP) + 1 for n in (16000, 20000))  # one per STFT frame
    assert res["thresholds"]["specialisation_abs_r"] == SPECIALISATION_R
    assert [L["layer"] for L in res["layers"]] == [1, 2, 3, 4, 5]
    for L in res["layers"]:
        assert set(L) >= {"speech_mechanism", "speech_r", "r", "r_clip_mean", "entropy_bits", "confidence"}
        assert len(L["r"]) == 2 and math.isclose(L["r"][0], -L["r"][1], abs_tol=1e-6)  # n_s = 2: mirror images
        assert L["speech_r"] == max(L["r"]) and 0 <= L["entropy_bits"] <= 1 and 0.5 <= L["confidence"] <= 1
    assert len(res["summary"]) == 3
    md = (out / "competition.md").read_text()
    assert md.count("\n| ") == 6 and res["summary"][1] in md
    assert mpimg.imread(out / "competition.png").ndim == 3

    assert main(["competition", "--model", str(tiny_ckpt), "--noisy", str(noisy), "--clean", str(clean),
                 "--out", str(tmp_path / "one"), "--limit", "1"]) == 0
    assert json.loads((tmp_path / "one" / "competition.json").read_text())["files"] == 1


def test_competition_cli_runs_an_onnx_model(tiny_onnx, tmp_path):
    noisy, clean = _pairs(tmp_path, n=1)
    assert main(["competition", "--model", str(tiny_onnx), "--noisy", str(noisy), "--clean", str(clean),
                 "--out", str(tmp_path / "out")]) == 0
    res = json.loads((tmp_path / "out" / "competition.json").read_text())
    assert res["n_tim"] == 5 and len(res["layers"]) == 5 and res["frames"] >= 55


def test_competition_cli_refuses_a_baseline_model(tmp_path, capsys):
    import torch

    from enhancer import ModelConfig, build_model, save_checkpoint

    torch.manual_seed(0)
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in TINY_MODEL.items() if k != "preset"}
    cfg = ModelConfig.preset("baseline", **kw)
    assert cfg.n_tim_layers == 0
    ckpt = save_checkpoint(build_model(cfg).eval(), cfg, tmp_path / "baseline.pt")
    noisy, clean = _pairs(tmp_path / "data", n=1)
    code = main(["competition", "--model", str(ckpt), "--noisy", str(noisy), "--clean", str(clean),
                 "--out", str(tmp_path / "out")])
    assert code != 0
    assert "no TIM layers" in capsys.readouterr().err
    assert not (tmp_path / "out" / "competition.json").exists()
