"""The README's usage section, run as written against a live service: its shell snippets in a fresh
shell (no environment activated, only `source .venv/bin/activate` as the README says), its Python
snippets with the interpreter of that environment, mono and stereo. A snippet that needs what a
test cannot have (`make`, Docker, a training corpus, a second server) is listed in NOT_RUN with the
reason; the browser example runs in tests/server/test_client_browser.py."""
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
VENV = Path(sys.executable).parent.parent  # the environment `make serve` / `make test` made
DEFAULT = "http://127.0.0.1:8000"

# command-line snippets that are not run here, and why
NOT_RUN = {
    "make": "installs the environment this test runs in",
    "docker": "needs a Docker daemon",
    "enhancer serve": "the test's own server stands in for it",
    "enhancer-train": "needs a training corpus (tests/training runs the quickstart)",
}


def usage() -> str:
    """The README's usage section ("Use it")."""
    text = README.read_text()
    start = text.index("\n## Use it\n")
    return text[start:text.index("\n## ", start + 1)]


def blocks(lang: str, text: str | None = None) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text() if text is None else text, flags=re.S | re.M)


def commands(text: str | None = None) -> list[str]:
    """Every command line of the sh blocks, comments removed."""
    lines = []
    for block in blocks("sh", text):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def runnable(line: str) -> bool:
    return not any(line.startswith(prefix) for prefix in NOT_RUN)


@pytest.fixture
def workdir(tmp_path):
    """A folder like the checkout for the snippets: .venv (the test's environment), noisy.wav,
    more.flac and recordings/."""
    if not (VENV / "bin" / "activate").is_file():
        pytest.skip(f"{sys.executable} does not run in a virtual environment with bin/activate")
    (tmp_path / ".venv").symlink_to(VENV)
    x, sr = sf.read(NOISY, dtype="float32")
    sf.write(tmp_path / "noisy.wav", x, sr, subtype="PCM_16")
    sf.write(tmp_path / "more.flac", x[: sr * 2], sr)
    (tmp_path / "recordings").mkdir()
    sf.write(tmp_path / "recordings" / "a.wav", x[sr:], sr, subtype="PCM_16")
    return tmp_path


def fresh_environment() -> dict:
    """A new shell's environment: no virtual environment active, its bin/ not on the PATH; the
    checkout under test on PYTHONPATH (the environment's editable install may be of another)."""
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p) != VENV / "bin"]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    return env | {"PATH": os.pathsep.join(path), "PYTHONPATH": str(ROOT)}


def test_the_readme_has_the_snippets_this_test_runs():
    text = README.read_text()
    cmds, use = commands(), usage()
    assert cmds[:2] == ["make serve", "make test"], "the README opens with the two set-up commands"
    assert "make serve PORT=" in text
    assert commands(use)[0] == "source .venv/bin/activate", "the usage section starts a fresh shell"
    for needed in ("curl -sS --fail-with-body ", "enhancer stream ", "enhancer denoise", "enhancer info"):
        assert any(c.startswith(needed) for c in commands(use)), needed
    assert "curl -sf" not in text and not re.search(r"curl [^\n]*-\w*f\w*\s", text.replace("--fail-with-body", ""))
    assert len(blocks("python", use)) == 2 and len(blocks("html", use)) == 1
    assert "http://127.0.0.1:8000/" in text
    assert len(text.splitlines()) <= 200


def run_python(code: str, cwd: Path) -> None:
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=fresh_environment(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("channels", [1, 2])
def test_the_python_snippet_runs_as_written(workdir, channels):
    if channels == 2:  # a stereo recording: the snippet takes its channels from the file
        x, sr = sf.read(workdir / "noisy.wav", dtype="float32")
        sf.write(workdir / "noisy.wav", np.stack([x, 0.7 * np.roll(x, 40)], axis=1), sr, subtype="PCM_16")
    run_python(blocks("python", usage())[0], workdir)
    x, sr = sf.read(workdir / "noisy.wav", dtype="float32", always_2d=True)
    offline, sr_off = sf.read(workdir / "clean.wav", dtype="float32", always_2d=True)
    live, sr_live = sf.read(workdir / "clean-live.wav", dtype="float32", always_2d=True)
    level, _ = sf.read(workdir / "clean-level.wav", dtype="float32", always_2d=True)
    assert sr_off == sr_live == sr and offline.shape == live.shape == level.shape == x.shape
    # the live stream gives the file's output within the shipped graph's 8-bit key/value rings (the
    # live step reads every earlier frame from them; README, Speed) and 16-bit WAV rounding
    assert snr_db(offline, live) > MIN_PARITY_SNR_DB
    # it removed something: the output differs from the input by more than rounding
    assert np.sqrt(np.mean((offline - x) ** 2)) > 0.05 * np.sqrt(np.mean(x ** 2))
    # level="input": louder than the model's level, not louder than the noisy input
    assert np.mean(offline ** 2) < np.mean(level ** 2) < np.mean(x ** 2)


def test_the_client_snippet_runs_as_written(live, workdir):
    run_python(blocks("python", usage())[1].replace(DEFAULT, live.base), workdir)
    x, sr = sf.read(workdir / "noisy.wav", dtype="float32")
    y, sr_y = sf.read(workdir / "clean-rest.flac", dtype="float32")
    assert sf.info(workdir / "clean-rest.flac").format == "FLAC" and sr_y == sr and y.shape == x.shape


def test_the_service_readme_client_snippet_runs_as_written(live, workdir):
    """server/README.md's Python client example (REST and a live stream) against the test's service."""
    text = (ROOT / "server" / "README.md").read_text()
    clients = text[text.index("\n## Clients\n"):text.index("\n### The browser module\n")]
    (code,) = blocks("python", clients)
    run_python(code.replace(DEFAULT, live.base) + "\nassert y.shape == x.shape, (y.shape, x.shape)\n", workdir)
    x, sr = sf.read(workdir / "noisy.wav", dtype="float32")
    y, sr_y = sf.read(workdir / "enhanced.flac", dtype="float32")
    assert sr_y == sr and y.shape == x.shape


def test_the_shell_snippets_run_as_written_in_a_fresh_shell(live, workdir):
    """Every command of the usage section, in order, in one new bash (`set -e`) that has only what
    the README's own lines give it: curl, enhancer stream and the command line against the test's
    service; each writes what it says."""
    lines = [ln.replace(DEFAULT, live.base) for ln in commands(usage()) if runnable(ln)]
    script = "set -euo pipefail\n" + "\n".join(f"printf '+ %s\\n' {shlex.quote(ln)} >&2\n{ln}" for ln in lines)
    done = subprocess.run(["bash", "-c", script], cwd=workdir, env=fresh_environment(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    ran = re.findall(r"^\+ (.*)$", done.stderr, flags=re.M)
    assert ran == lines and any(ln.startswith("enhancer stream") for ln in ran)
    x, sr = sf.read(workdir / "noisy.wav", dtype="float32")
    for name in ("clean.wav", "clean-ws.wav"):
        y, sr_y = sf.read(workdir / name, dtype="float32")
        assert sr_y == sr and y.shape == x.shape, name
    for name, n in (("enhanced/a.wav", len(x) - sr), ("enhanced/more.flac", 2 * sr)):
        y, sr_y = sf.read(workdir / name, dtype="float32")
        assert sr_y == sr and len(y) == n, name
    assert "64 ms algorithmic" in done.stdout  # enhancer info: the model's latency


def test_curl_shows_the_service_error(live, workdir):
    """The README's curl, sent a file that is not audio: a non-zero exit and the service's JSON
    error in the output file."""
    curl = next(c for c in commands(usage()) if c.startswith("curl "))
    (workdir / "noisy.wav").write_bytes(b"this is not audio" * 10)
    done = subprocess.run(["bash", "-c", curl.replace(DEFAULT, live.base)], cwd=workdir, env=fresh_environment(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 22 and "415" in done.stderr, done.stderr
    assert '"kind":"unsupported_media"' in (workdir / "clean.wav").read_text().replace(" ", "")
