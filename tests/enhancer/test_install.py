"""Packaging: the wheel carries the shipped model (and no test or benchmark harness), a non-editable
install finds the model, and the Docker build context leaves the harness out."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from enhancer import runtime

ROOT = Path(__file__).resolve().parents[2]


def test_default_model_lookup_order(tmp_path, monkeypatch):
    monkeypatch.delenv(runtime.MODEL_ENV, raising=False)
    installed, checkout = tmp_path / "site" / "enhancer" / "models", tmp_path / "repo" / "models"
    monkeypatch.setattr(runtime, "PACKAGE_MODELS_DIR", installed)
    monkeypatch.setattr(runtime, "MODELS_DIR", checkout)
    assert runtime.default_model_path() == checkout / "tim.onnx"  # nothing anywhere: named in the error
    with pytest.raises(runtime.CheckpointError, match="no shipped model at .*site/enhancer/models/tim.onnx or "):
        runtime.Enhancer.from_pretrained()
    checkout.mkdir(parents=True)
    (checkout / "tim.onnx").write_bytes(b"x")
    assert runtime.default_model_path() == checkout / "tim.onnx"  # a source checkout / editable install
    installed.mkdir(parents=True)
    (installed / "tim.onnx").write_bytes(b"x")
    assert runtime.default_model_path() == installed / "tim.onnx"  # an installed wheel
    monkeypatch.setenv(runtime.MODEL_ENV, str(tmp_path / "mine.onnx"))
    assert runtime.default_model_path() == tmp_path / "mine.onnx"


def test_pyproject_ships_the_model_as_package_data():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    st = cfg["tool"]["setuptools"]
    assert st["package-dir"]["enhancer.models"] == "models" and "enhancer.models" in st["packages"]
    assert "tim.onnx" in st["package-data"]["enhancer.models"]
    assert cfg["project"]["license"] == "MIT"  # an SPDX expression, not the deprecated table


@pytest.mark.slow
def test_wheel_install_finds_the_shipped_model_from_another_folder(tmp_path):
    """Build the wheel (no warnings), install it into a folder of its own, and load the default
    model from a process that cannot see the repository."""
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                            "-w", str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True, cwd=tmp_path)
    log = build.stdout + build.stderr  # -v: the build backend's own output, warnings included
    assert build.returncode == 0, log[-3000:]
    assert "running bdist_wheel" in log  # the backend's output is really in the log
    assert "Warning" not in log and "deprecated" not in log.lower(), log[-3000:]
    wheel = next((tmp_path / "dist").glob("tim_enhancer-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {"enhancer/models/tim.onnx", "server/static/index.html", "training/quickstart.json"} <= names
    harness = [n for n in names if n.startswith(("server/tools/", "training/peers/"))]
    assert not harness, harness  # the test and benchmark tools run from a checkout, they are not shipped
    assert "License-Expression: MIT" in meta
    site = tmp_path / "site"
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert inst.returncode == 0, inst.stderr[-3000:]
    code = ("import numpy as np, enhancer; from enhancer.runtime import Enhancer; e = Enhancer.from_pretrained(); "
            "y = e.enhance(np.random.default_rng(0).standard_normal(16000).astype('float32') * 0.1, 16000); "
            "print(enhancer.__file__); print(e.engine.path); print(y.shape, bool(np.isfinite(y).all()))")
    env = {k: v for k, v in os.environ.items() if k not in (runtime.MODEL_ENV, "PYTHONPATH")} | {"PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path / "dist", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    module, model, result = run.stdout.strip().splitlines()
    assert module.startswith(str(site)) and model == str(site / "enhancer" / "models" / "tim.onnx"), run.stdout
    assert result == "(16000,) True"


def test_docker_context_leaves_the_harness_out():
    ignored = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")}
    assert {"server/tools", "training/peers", "tests"} <= ignored
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert not {"server.tools", "training.peers"} & set(cfg["tool"]["setuptools"]["packages"])
