"""The quickstart of training/README.md, run as written (commands taken from the page) at a smaller
scale: generated noise, a few steps on the shared speech, export, evaluation."""
from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pytest

from enhancer.cli import main as enhancer_main
from training.cli import main as train_main

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"

# appended to each documented command: later flags override earlier ones
SMALLER = {
    "synth-noise": ["--files-per-kind", "2", "--seconds", "2", "--quiet"],
    "fit": ["--max-steps", "4", "--valid-every", "2", "--batch-size", "2", "--valid-examples", "4",
            "--norm-examples", "8", "--threads", "1", "--quiet"],
    "export": ["-q"],
    "eval": ["--no-dnsmos", "--limit", "2"],
}


def quickstart_commands() -> list[list[str]]:
    text = (ROOT / "training" / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return [shlex.split(line.strip()) for line in section.splitlines() if line.startswith("    .venv/bin/")]


def test_the_readme_has_the_four_quickstart_steps():
    cmds = quickstart_commands()
    assert [(Path(c[0]).name, c[1]) for c in cmds] == [("enhancer-train", "synth-noise"), ("enhancer-train", "fit"),
                                                        ("enhancer", "export"), ("enhancer-train", "eval")]
    assert all(Path(a).is_file() for c in cmds for a in c if a.startswith("training/"))


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "speech" / "files.tsv").is_file(), reason="../shared/data/speech not present")
def test_quickstart_runs_as_documented(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the page's commands run from the repository root
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the default audio cache, under the test's folder
    out = tmp_path / "quick"
    for cmd in quickstart_commands():
        args = [str(out) + a[len("runs/quick"):] if a.startswith("runs/quick") else a for a in cmd[1:]]
        args += SMALLER[cmd[1]]
        main = enhancer_main if Path(cmd[0]).name == "enhancer" else train_main
        assert main(args) == 0, (cmd, capsys.readouterr().err[-3000:])
    assert (out / "run" / "checkpoints" / "best.pt").is_file()
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert summary["files"] == 2 and all(math.isfinite(summary[t]["pesq_wb"]) for t in ("noisy", "enhanced"))
    assert (out / "report" / "enhanced").is_dir()
    err = capsys.readouterr().err
    assert "comparing onnxruntime with torch" not in err  # export -q is quiet
    assert "evaluating" in err and "PESQ-WB" in err  # eval says what it scores
