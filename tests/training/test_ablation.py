"""`enhancer-train ablation`: the table is built from the run folders and reports as written."""
from __future__ import annotations

import json

from enhancer import ModelConfig, build_model
from enhancer.build.model import count_parameters
from tests.training.conftest import TINY_MODEL
from training.cli import main


def fake_run(root, name, examples, wall_h, valid, pesq, segment=2.0, files=10):
    run, report = root / f"run-{name}", root / f"eval-{name}"
    run.mkdir()
    report.mkdir()
    cfg = ModelConfig.preset(name, **{k: tuple(v) if isinstance(v, list) else v for k, v in TINY_MODEL.items()
                                      if k != "preset"})
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    (run / "train.json").write_text(json.dumps({"mix": {"segment_seconds": segment, "snr_db": [-5, 25]}}))
    rows = ["step,examples,hours,split,loss,lr,audio_s_per_s,grad_norm", f"10,{examples // 2},{wall_h / 2},train,3.0,1e-4,30,1"]
    rows += [f"{10 * (i + 1)},{examples},{wall_h},valid,{v},1e-4,nan,nan" for i, v in enumerate(valid)]
    rows.append(f"20,{examples},{wall_h},train,2.5,1e-4,30,1")
    (run / "metrics.csv").write_text("\n".join(rows) + "\n")
    scores = {"pesq_wb": pesq, "stoi": 0.8, "estoi": 0.6, "si_sdr": 9.0, "dnsmos_ovrl": 2.5}
    (report / "summary.json").write_text(json.dumps({"files": files, "noisy": scores | {"pesq_wb": 1.5},
                                                     "enhanced": scores}))
    # per file: PESQ-WB pesq + 0.1 * (i - 2) for files f0..f4 (mean = pesq); the other metrics fixed
    lines = ["name,seconds,noisy_pesq_wb,enhanced_pesq_wb,enhanced_stoi,enhanced_si_sdr,enhanced_dnsmos_ovrl"]
    lines += [f"f{i}.wav,9.0,1.5,{pesq + 0.1 * (i - 2)},0.8,9.0,2.5" for i in range(5)]
    (report / "per_file.csv").write_text("\n".join(lines) + "\n")
    return str(run), str(report), count_parameters(build_model(cfg))


def test_table_reads_budget_best_loss_parameters_and_scores(tmp_path, capsys):
    rb, eb, pb = fake_run(tmp_path, "baseline", 3600, 0.5, [2.0, 1.7, 1.9], 1.75)
    rt, et, pt = fake_run(tmp_path, "tim", 3600, 0.8, [1.9, 1.6], 1.81)
    out = tmp_path / "ablation.md"
    assert main(["ablation", "--run", rb, "--eval", eb, "--run", rt, "--eval", et, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[2].startswith("| noisy input") and "1.500" in lines[2]
    assert lines[3] == f"| `baseline` | {pb:,} | 2.00 | 0.50 | 1.7000 | 1.750 | **0.800** | **9.00** | **2.50** |"
    assert lines[4].startswith(f"| `tim` | {pt:,} | 2.00 | 0.80 | 1.6000 | **1.810** |")
    assert "warning" not in text
    # paired difference from the first run: every file +0.06 -> mean +0.060, interval collapsed on it
    assert lines[8] == "| `tim` | +0.060 [+0.060, +0.060] | +0.000 [+0.000, +0.000] | +0.00 [+0.00, +0.00] | +0.00 [+0.00, +0.00] |"
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [r["best_valid_step"] for r in rows] == [20, 20] and out.read_text() == text


def test_paired_interval_covers_the_mean_and_spans_zero_for_noise():
    from training.evaluation.ablation import paired

    ref = {f"f{i}": {"pesq_wb": 2.0} for i in range(50)}
    noise = {f"f{i}": {"pesq_wb": 2.0 + (0.1 if i % 2 else -0.1)} for i in range(50)}
    mean, lo, hi, n = paired(ref, noise, "pesq_wb")
    assert n == 50 and abs(mean) < 1e-12 and lo < 0 < hi
    better = {f"f{i}": {"pesq_wb": 2.2 + (0.1 if i % 2 else -0.1)} for i in range(50)}
    mean, lo, hi, _ = paired(ref, better, "pesq_wb")
    assert abs(mean - 0.2) < 1e-9 and 0.15 < lo < mean < hi < 0.25


def test_unequal_budgets_are_flagged_and_missing_reports_are_errors(tmp_path, capsys):
    rb, eb, _ = fake_run(tmp_path, "baseline", 3600, 0.5, [2.0], 1.7)
    rt, et, _ = fake_run(tmp_path, "tim", 7200, 0.9, [1.9], 1.8)
    assert main(["ablation", "--run", rb, "--eval", eb, "--run", rt, "--eval", et]) == 0
    assert "warning: the runs saw different amounts of audio (2.00 h, 4.00 h)" in capsys.readouterr().out
    assert main(["ablation", "--run", rb, "--eval", str(tmp_path / "nope")]) == 2
    assert "summary.json: not found" in capsys.readouterr().err
    assert main(["ablation", "--run", rb, "--eval", eb, "--run", rt]) == 2
