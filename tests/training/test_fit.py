"""`enhancer-train fit` on a tiny generated corpus: learning, exact resume, checkpoints, SIGTERM,
bad input, and a 2-process torchrun run."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from enhancer import load_checkpoint
from training.cli import main
from training.data.layouts import corpus_layout
from training.loop import FitOptions, Trainer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def fit_args(corpus, cfg, cache, out, steps, *extra):
    return ["fit", "--config", str(cfg), "--data", str(corpus), "--out", str(out), "--max-steps", str(steps),
            "--batch-size", "4", "--segment-seconds", "0.5", "--valid-every", "0", "--log-every", "1",
            "--norm-examples", "8", "--valid-examples", "4", "--valid-seconds", "1", "--cache-dir", str(cache),
            "--threads", "1", "--precision", "fp32", "--lr", "3e-3", "--jobs", "1", "--quiet", *extra]


def losses(out: Path, split: str = "train") -> dict[int, str]:
    with open(out / "metrics.csv", newline="") as f:
        return {int(r["step"]): r["loss"] for r in csv.DictReader(f) if r["split"] == split}


def test_fit_lowers_loss_and_resumes_exactly(corpus, tiny_config, cache_dir, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(fit_args(corpus, tiny_config, cache_dir, a, 40)) == 0
    la = losses(a)
    assert sorted(la) == list(range(1, 41))
    first = sum(float(la[i]) for i in range(1, 11)) / 10
    last = sum(float(la[i]) for i in range(31, 41)) / 10
    assert last < 0.8 * first, (first, last)

    assert main(fit_args(corpus, tiny_config, cache_dir, b, 20)) == 0
    assert (b / "checkpoints" / "step-00000020.pt").is_file()
    assert main(fit_args(corpus, tiny_config, cache_dir, b, 40)) == 0  # resumes by default
    lb = losses(b)
    assert [lb[i] for i in range(1, 41)] == [la[i] for i in range(1, 41)]  # bit-identical after the resume

    model = load_checkpoint(b / "checkpoints" / "step-00000040.pt")
    extra = model.checkpoint["extra"]
    assert extra["train"]["step"] == 40 and extra["train"]["examples"] == 160
    assert not torch.allclose(model.feat_mean, torch.zeros_like(model.feat_mean))  # statistics were set
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == ["step-00000020.pt", "step-00000040.pt"]


def test_validation_best_checkpoint_and_keep_last(corpus, tiny_config, cache_dir, tmp_path):
    out = tmp_path / "run"
    assert main(fit_args(corpus, tiny_config, cache_dir, out, 12, "--valid-every", "3", "--keep-last", "2")) == 0
    valid = losses(out, "valid")
    assert sorted(valid) == [3, 6, 9, 12]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["best.pt", "step-00000009.pt", "step-00000012.pt"]
    best = load_checkpoint(out / "checkpoints" / "best.pt").checkpoint["extra"]["train"]
    assert best["best_valid"] == pytest.approx(min(float(v) for v in valid.values()), rel=1e-5)
    # the best checkpoint exports with `enhancer export` (checked against torch by the exporter)
    from enhancer.cli import main as enhancer_main

    assert enhancer_main(["export", str(out / "checkpoints" / "best.pt"), "-o", str(tmp_path / "best.onnx")]) == 0
    assert (tmp_path / "best.onnx").stat().st_size > 0


def test_plateau_halves_learning_rate(corpus, tmp_path):
    t = Trainer(FitOptions(out=tmp_path, patience=2), corpus_layout(corpus))
    t.opts, t.lr, t.best, t.bad = t.opts, 2e-4, float("inf"), 0
    t.opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=2e-4)
    t.log = lambda *_: None
    assert t.after_validation(1.0) is True
    assert t.after_validation(1.0) is False and t.lr == 2e-4
    assert t.after_validation(1.1) is False and t.lr == 1e-4 and t.opt.param_groups[0]["lr"] == 1e-4
    assert t.after_validation(0.9) is True and t.bad == 0


def test_resume_refuses_a_different_model(corpus, tiny_config, cache_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(fit_args(corpus, tiny_config, cache_dir, out, 2)) == 0
    args = fit_args(corpus, tiny_config, cache_dir, out, 4)
    args[args.index("--config"):args.index("--config") + 2] = ["--preset", "baseline"]
    assert main(args) == 2
    assert "different model" in capsys.readouterr().err
    assert main(fit_args(corpus, tiny_config, cache_dir, out, 4, "--no-resume")) == 2
    assert "already holds checkpoints" in capsys.readouterr().err


def test_bad_data_is_a_clear_error_before_training(corpus, tiny_config, cache_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(fit_args(tmp_path / "no-such-folder", tiny_config, cache_dir, out, 2)) == 2
    assert "data folder not found" in capsys.readouterr().err
    empty = tmp_path / "empty"
    (empty / "manifests").mkdir(parents=True)
    for split in ("train", "valid"):
        for cat in ("speech", "noise"):
            src = corpus / "manifests" / f"{cat}_{split}.tsv"
            (empty / "manifests" / src.name).write_text(src.read_text() if cat == "noise" else "path\tseconds\n")
    assert main(fit_args(empty, tiny_config, cache_dir, out, 2)) == 2
    assert "speech_train.tsv lists no files" in capsys.readouterr().err
    assert not out.exists()  # nothing started
    args = fit_args(corpus, tiny_config, cache_dir, out, 2)
    args[args.index("--data"):args.index("--data") + 2] = []
    assert main(args) == 2
    assert "give exactly one data source" in capsys.readouterr().err
    assert main(fit_args(corpus, tiny_config, cache_dir, out, 2, "--pitch-filter-loss")) == 2
    assert "needs a model with a pitch filter" in capsys.readouterr().err
    assert not out.exists()


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_sigterm_writes_a_checkpoint(corpus, tiny_config, cache_dir, tmp_path):
    out = tmp_path / "run"
    args = fit_args(corpus, tiny_config, cache_dir, out, 100000)
    args.remove("--quiet")
    proc = subprocess.Popen([sys.executable, "-m", "training.cli", *args], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while (time.time() < deadline and not (out / "metrics.csv").exists()) or len(losses(out)) < 3:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "received SIGTERM" in err
    steps = sorted(losses(out))
    saved = load_checkpoint(sorted((out / "checkpoints").glob("step-*.pt"))[-1]).checkpoint["extra"]["train"]["step"]
    assert saved == steps[-1] >= 3


def test_torchrun_two_processes(corpus, tiny_config, cache_dir, tmp_path):
    out = tmp_path / "ddp"
    args = fit_args(corpus, tiny_config, cache_dir, out, 3, "--valid-every", "3")
    args[args.index("--threads") + 1] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "training.cli", *args]
    r = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(losses(out)) == [1, 2, 3] and list(losses(out, "valid")) == [3]
    extra = load_checkpoint(out / "checkpoints" / "step-00000003.pt").checkpoint["extra"]
    assert extra["train"]["world_size"] == 2 and extra["train"]["examples"] == 3 * 2 * 4
    assert len(extra["rng"]) == 2  # both ranks' dropout generators, for an exact resume


def test_dns_root_and_manifest_sources(tmp_path, corpus):
    import soundfile as sf

    from tests.conftest import speechlike
    from training.cli import build_parser
    from training.fit import training_data

    ds = tmp_path / "DNS-Challenge" / "datasets"
    (ds / "clean").mkdir(parents=True)
    (ds / "noise").mkdir()
    for i in range(8):
        sf.write(str(ds / "clean" / f"book_{i:05d}_chp_0001_reader_{i % 4:05d}_{i}.wav"), speechlike(8000, seed=i), 16000)
        sf.write(str(ds / "noise" / f"n{i}.wav"), speechlike(8000, seed=50 + i), 16000)
    args = build_parser().parse_args(["fit", "--dns-root", str(tmp_path / "DNS-Challenge"), "--out", str(tmp_path / "o")])
    data = training_data(args)
    assert len(data.train["speech"]) + len(data.valid["speech"]) == 8 and data.valid["speech"] and data.train["noise"]
    m = corpus / "manifests"
    args = build_parser().parse_args(["fit", "--speech", f"{m}/speech_train.tsv,{m}/speech_valid.tsv",
                                      "--noise", f"{m}/noise_train.tsv", "--out", str(tmp_path / "o")])
    data = training_data(args)
    assert len(data.valid["speech"]) == 6 and data.train["music"] == []
    assert len(data.train["noise"]) + len(data.valid["noise"]) == 4 and data.valid["noise"]


def test_max_minutes_stops_and_checkpoints(corpus, tiny_config, cache_dir, tmp_path, capsys):
    out = tmp_path / "run"
    args = fit_args(corpus, tiny_config, cache_dir, out, 100000, "--max-minutes", "0.001")
    args.remove("--quiet")
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "reached --max-minutes" in err
    steps = sorted(losses(out))
    assert 1 <= len(steps) < 100 and (out / "checkpoints" / f"step-{steps[-1]:08d}.pt").is_file()


def test_init_fine_tunes_from_shipped_style_weights(corpus, tiny_config, cache_dir, tmp_path):
    """--init starts a new run from a weights-only checkpoint (like models/tim.pt): its config and
    feature statistics are kept and the first loss is the loss the base run had reached."""
    base = tmp_path / "base"
    assert main(fit_args(corpus, tiny_config, cache_dir, base, 30)) == 0
    trained = load_checkpoint(base / "checkpoints" / "step-00000030.pt")
    from enhancer import save_checkpoint

    weights = save_checkpoint(trained, trained.config, tmp_path / "ship.pt", half=True)  # no training state
    ft, fresh = tmp_path / "ft", tmp_path / "fresh"
    assert main(fit_args(corpus, tiny_config, cache_dir, ft, 5, "--init", str(weights))) == 0
    assert main(fit_args(corpus, tiny_config, cache_dir, fresh, 5)) == 0
    tuned = load_checkpoint(ft / "checkpoints" / "step-00000005.pt")
    assert torch.equal(tuned.feat_mean, trained.feat_mean.half().float())
    assert float(losses(ft)[1]) < 0.9 * float(losses(fresh)[1])
    assert main(fit_args(corpus, tiny_config, cache_dir, tmp_path / "bad", 5, "--init", str(tmp_path / "none.pt"))) == 2


def test_loss_floor_is_recorded_and_changes_the_objective(corpus, tiny_config, cache_dir, tmp_path):
    """--loss-floor reaches the objective: the same data and seed give another first loss (the
    floored one is smaller: quiet bins count less), and train.json records it."""
    import json

    plain, floored = tmp_path / "plain", tmp_path / "floored"
    assert main(fit_args(corpus, tiny_config, cache_dir, plain, 2)) == 0
    assert main(fit_args(corpus, tiny_config, cache_dir, floored, 2, "--loss-floor", "1e-2")) == 0
    assert json.loads((floored / "train.json").read_text())["options"]["loss_floor"] == 1e-2
    assert float(losses(floored)[1]) < 0.8 * float(losses(plain)[1])


def test_waveform_terms_reach_the_trainer_and_change_the_loss(corpus, tiny_config, cache_dir, tmp_path):
    """`--sisdr-weight`, `--mrstft-weight` and `--residual-weight` are recorded in train.json and change
    the training loss from the first step (same data, same initial weights: only the objective differs)."""
    runs = {"plain": (), "sisdr": ("--sisdr-weight", "0.01"), "mrstft": ("--mrstft-weight", "0.2"),
            "residual": ("--residual-weight", "50")}
    first = {}
    for name, extra in runs.items():
        out = tmp_path / name
        assert main(fit_args(corpus, tiny_config, cache_dir, out, 2, *extra)) == 0
        opts = json.loads((out / "train.json").read_text())["options"]
        assert opts["sisdr_weight"] == (0.01 if name == "sisdr" else 0.0)
        assert opts["mrstft_weight"] == (0.2 if name == "mrstft" else 0.0)
        assert opts["residual_weight"] == (50.0 if name == "residual" else 0.0)
        first[name] = float(losses(out)[1])
    assert abs(first["sisdr"] - first["plain"]) > 1e-3 * abs(first["plain"])  # 0.01 x the mean -SI-SDR (dB)
    assert first["mrstft"] > first["plain"] * (1 + 1e-3)  # a positive term added
    assert first["residual"] > first["plain"] * (1 + 1e-3)


def test_context_note_flags_segments_where_under_a_third_of_the_frames_see_the_whole_window():
    from enhancer import ModelConfig
    from training.loop import context_note

    cfg = ModelConfig.preset("tim")  # 128-frame window, 256-sample hop, 2 frames of lookahead
    note = context_note(cfg, 2 * 16000)  # 126 frames, 124 trained on: none sees the whole window
    assert note is not None and "0 of the 124 frames" in note and "3.1 s" in note
    assert "62 of the 187 frames" in context_note(cfg, 188 * 256)  # 189 frames: 3 x 62 < 187
    assert context_note(cfg, 189 * 256) is None  # 190 frames: 3 x 63 >= 188
    assert context_note(cfg, 4 * 16000) is None


def test_dropout_is_a_run_setting_kept_on_resume(corpus, tiny_config, cache_dir, tmp_path, capsys):
    """--dropout 0 changes the training loss from the first step (same data and initial weights),
    is recorded in train.json and the checkpoints' training state, survives a resume without the
    flag, and leaves the model config (what the export and the runtime read) unchanged."""
    plain, off = tmp_path / "plain", tmp_path / "off"
    assert main(fit_args(corpus, tiny_config, cache_dir, plain, 2)) == 0
    assert main(fit_args(corpus, tiny_config, cache_dir, off, 2, "--dropout", "0")) == 0
    assert json.loads((off / "train.json").read_text())["options"]["dropout"] == 0.0
    assert losses(off)[1] != losses(plain)[1]
    assert main(fit_args(corpus, tiny_config, cache_dir, off, 4)) == 0  # resumes, no --dropout given
    model = load_checkpoint(off / "checkpoints" / "step-00000004.pt")
    assert model.checkpoint["extra"]["train"]["dropout"] == 0.0
    assert model.config.dropout == json.loads(tiny_config.read_text()).get("dropout", 0.1) > 0
    assert load_checkpoint(plain / "checkpoints" / "step-00000002.pt").checkpoint["extra"]["train"]["dropout"] is None
    capsys.readouterr()
    assert main(fit_args(corpus, tiny_config, cache_dir, tmp_path / "bad", 2, "--dropout", "1")) == 2
    assert "--dropout must lie in [0, 1)" in capsys.readouterr().err
