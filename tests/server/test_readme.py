"""The README's snippets, run as written against a live server: the Python block, the REST call,
the websocket client and the command lines. A snippet that needs what a test cannot have (`make`,
Docker, a training corpus, a second server) is listed in NOT_RUN with the reason."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from enhancer.build.quantize import MIN_PARITY_SNR_DB
from tests.tolerance import snr_db

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
NOISY = ROOT / "tests" / "fixtures" / "golden" / "noisy.flac"
BIN = Path(sys.executable).parent
DEFAULT_HTTP, DEFAULT_WS = "http://127.0.0.1:8000", "ws://127.0.0.1:8000"

# command-line snippets that are not run here, and why
NOT_RUN = {
    "make": "installs the environment this test runs in",
    "docker": "needs a Docker daemon",
    "enhancer serve": "the test's own server stands in for it",
    "enhancer-train": "needs a training corpus (tests/training runs the quickstart)",
}


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def commands() -> list[str]:
    """Every command line of the README's sh blocks and inline `docker ...` / `curl ...` spans,
    comments removed."""
    lines = []
    for block in blocks("sh"):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def runnable(line: str) -> bool:
    return not any(line.startswith(prefix) for prefix in NOT_RUN)


@pytest.fixture
def workdir(tmp_path):
    """A folder holding what the snippets read: noisy.wav, more.flac and recordings/."""
    x, sr = sf.read(NOISY, dtype="float32")
    sf.write(tmp_path / "noisy.wav", x, sr, subtype="PCM_16")
    sf.write(tmp_path / "more.flac", x[: sr * 2], sr)
    (tmp_path / "recordings").mkdir()
    sf.write(tmp_path / "recordings" / "a.wav", x[sr:], sr, subtype="PCM_16")
    return tmp_path


def test_the_readme_has_the_snippets_this_test_runs():
    assert len(blocks("python")) == 1
    cmds = commands()
    assert cmds[:2] == ["make serve", "make test"], "the README opens with the two set-up commands"
    for needed in ("curl ", "python -m enhancer.client", "enhancer denoise", "enhancer info"):
        assert any(c.startswith(needed) for c in cmds), needed
    assert "http://127.0.0.1:8000/" in README.read_text()
    assert len(README.read_text().splitlines()) <= 200


def test_python_snippet_runs_as_written(workdir):
    code = blocks("python")[0]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    x, sr = sf.read(workdir / "noisy.wav", dtype="float32")
    offline, sr_off = sf.read(workdir / "clean.wav", dtype="float32")
    live, sr_live = sf.read(workdir / "clean-live.wav", dtype="float32")
    assert sr_off == sr_live == sr and offline.shape == live.shape == x.shape
    # the live stream gives the file's output within the shipped graph's 8-bit key/value rings (the
    # live step reads every earlier frame from them; README, Speed) and 16-bit WAV rounding
    assert snr_db(offline, live) > MIN_PARITY_SNR_DB
    # it removed something: the output differs from the input by more than rounding
    assert np.sqrt(np.mean((offline - x) ** 2)) > 0.05 * np.sqrt(np.mean(x ** 2))


def test_command_lines_run_as_written(live, workdir):
    """curl, the websocket client and the CLI against the test server; each writes what it says."""
    ran = []
    for line in filter(runnable, commands()):
        line = line.replace(DEFAULT_HTTP, live.base).replace(DEFAULT_WS, live.base.replace("http", "ws", 1))
        argv = shlex.split(line)
        if argv[0] == "python":
            argv[0] = sys.executable
        elif argv[0] == "enhancer":
            argv[0] = str(BIN / "enhancer")
        done = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        ran.append((argv[0], done.stdout))
    x, sr = sf.read(workdir / "noisy.wav", dtype="float32")
    for name in ("clean.wav", "clean-ws.wav"):
        y, sr_y = sf.read(workdir / name, dtype="float32")
        assert sr_y == sr and y.shape == x.shape, name
    for name, n in (("enhanced/a.wav", len(x) - sr), ("enhanced/more.flac", 2 * sr)):
        y, sr_y = sf.read(workdir / name, dtype="float32")
        assert sr_y == sr and len(y) == n, name
    info = next(out for prog, out in ran if prog.endswith("enhancer") and "latency" in out.lower())
    assert "64" in info
