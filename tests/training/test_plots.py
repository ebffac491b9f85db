"""`enhancer-train plot`: the spectrogram/competition figure and the training curves."""
from __future__ import annotations

import csv

import matplotlib.image as mpimg
import numpy as np
import soundfile as sf

from tests.conftest import speechlike
from tests.tolerance import assert_close_to_peak
from training.cli import main
from training.evaluation.plots import enhance_with_competition


def test_competition_scores_from_checkpoint_and_onnx_agree(tiny_model, tiny_ckpt, tiny_onnx):
    ckpt = tiny_ckpt
    x = speechlike(16000, seed=2)
    y_t, comp_t, hop_t = enhance_with_competition(ckpt, x)
    y_o, comp_o, hop_o = enhance_with_competition(tiny_onnx, x)
    cfg = tiny_model.config
    assert hop_t == hop_o == 0.016
    assert comp_t.shape == (64, cfg.n_tim_layers, cfg.n_mechanisms)  # one row per STFT frame
    np.testing.assert_allclose(comp_t.sum(-1), 1.0, atol=1e-5)
    n = min(len(comp_t), len(comp_o))
    assert n >= 55
    np.testing.assert_allclose(comp_o[:n], comp_t[:n], atol=1e-3)  # aligned frame for frame
    assert_close_to_peak(y_o, y_t)


def test_plot_example_and_curves_write_pngs(tiny_onnx, tmp_path):
    sf.write(str(tmp_path / "noisy.wav"), speechlike(16000, seed=1) + 0.01, 16000)
    sf.write(str(tmp_path / "clean.wav"), speechlike(16000, seed=1), 16000)
    out = tmp_path / "fig.png"
    assert main(["plot", "--model", str(tiny_onnx), "--noisy", str(tmp_path / "noisy.wav"), "--clean",
                 str(tmp_path / "clean.wav"), "--out", str(out)]) == 0
    img = mpimg.imread(out)
    assert img.ndim == 3 and img.shape[0] > img.shape[1] * 0.5  # three spectrograms + 5 TIM layers stacked

    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "examples", "hours", "split", "loss", "lr", "audio_s_per_s", "grad_norm"])
        for s in range(1, 61):
            w.writerow([s, 16 * s, s / 1000, "train", 2.0 / s ** 0.3, 2e-4 if s < 40 else 1e-4, 40.0, 1.0])
            if s % 20 == 0:
                w.writerow([s, 16 * s, s / 1000, "valid", 1.5 / s ** 0.3, 2e-4, "nan", "nan"])
    assert main(["plot", "--run", str(run), "--out", str(tmp_path / "curves.png")]) == 0
    assert mpimg.imread(tmp_path / "curves.png").shape[2] in (3, 4)


def test_plot_argument_errors(tmp_path, capsys):
    assert main(["plot", "--out", str(tmp_path / "x.png")]) == 2
    assert "give --model and --noisy" in capsys.readouterr().err
    assert main(["plot", "--metrics", str(tmp_path / "none.csv"), "--out", str(tmp_path / "x.png")]) == 2
    assert "metrics file not found" in capsys.readouterr().err
