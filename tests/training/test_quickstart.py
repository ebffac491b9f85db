"""The quickstart of training/README.md, run as written (commands taken from the page) at a smaller
scale: generated noise, a few steps on the speech that ships in the repository, export, evaluation.
It needs nothing beside the clone: every path the commands read is tracked by git, and the run
does not see `../shared` even where a development machine has one."""
from __future__ import annotations

import json
import math
import shlex
import subprocess
from pathlib import Path

import pytest

from enhancer.cli import main as enhancer_main
from training.cli import main as train_main
from training.defaults import Defaults

ROOT = Path(__file__).resolve().parents[2]

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


def read_paths(cmds) -> list[str]:
    """The arguments that name something the commands read (not what they write under runs/)."""
    return [a for c in cmds for a in c[2:] if "/" in a and not a.startswith("runs/")]


def test_the_readme_has_the_four_quickstart_steps():
    cmds = quickstart_commands()
    assert [(Path(c[0]).name, c[1]) for c in cmds] == [("enhancer-train", "synth-noise"), ("enhancer-train", "fit"),
                                                        ("enhancer", "export"), ("enhancer-train", "eval")]
    assert read_paths(cmds), "the quickstart reads speech and a noisy/clean pair from the repository"


def test_the_quickstart_reads_only_what_a_fresh_clone_has():
    tracked = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    tracked_paths = {line.split("\t", 1)[1] for line in tracked.splitlines()}
    for a in read_paths(quickstart_commands()):
        assert not a.startswith("..") and (ROOT / a).resolve().is_relative_to(ROOT), a
        assert (ROOT / a).exists(), a
        if (ROOT / a).is_dir():
            files = [p for p in tracked_paths if p.startswith(a.rstrip("/") + "/")]
            assert files, f"{a}: nothing tracked there"
        else:
            assert a in tracked_paths, f"{a} is not tracked by git"
            files = [a]
        for f in files:  # what the files point to (the speech manifest's rows, the pair's links) is tracked too
            p = ROOT / f
            if p.is_symlink():
                assert str(p.resolve().relative_to(ROOT)) in tracked_paths, f
            if p.suffix == ".tsv":
                rows = [line.split("\t")[0] for line in p.read_text().splitlines()[1:] if line]
                assert rows and all(str((p.parent / r).resolve().relative_to(ROOT)) in tracked_paths for r in rows), f


@pytest.mark.slow
def test_quickstart_runs_as_documented(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the page's commands run from the repository root
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the default audio cache, under the test's folder
    # as in a fresh clone: no ../shared beside the checkout (no DNSMOS models, no real pairs)
    monkeypatch.setattr(Defaults, "beside_checkout",
                        classmethod(lambda cls, shared_data=None: cls(dnsmos_dir=None, real_pairs=tmp_path / "no-shared")))
    out = tmp_path / "quick"
    for cmd in quickstart_commands():
        args = [str(out) + a[len("runs/quick"):] if a.startswith("runs/quick") else a for a in cmd[1:]]
        args += SMALLER[cmd[1]]
        main = enhancer_main if Path(cmd[0]).name == "enhancer" else train_main
        assert main(args) == 0, (cmd, capsys.readouterr().err[-3000:])
    assert (out / "run" / "checkpoints" / "best.pt").is_file()
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert summary["files"] == 1 and all(math.isfinite(summary[t]["pesq_wb"]) for t in ("noisy", "enhanced"))
    assert (out / "report" / "enhanced").is_dir()
    err = capsys.readouterr().err
    assert "comparing onnxruntime with torch" not in err  # export -q is quiet
    assert "evaluating" in err and "PESQ-WB" in err  # eval says what it scores
