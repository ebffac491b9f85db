"""Packaging: the wheel carries the shipped model (and no test or benchmark harness), a non-editable
install finds the model, and the Docker build context leaves the harness out."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

from enhancer import runtime
from enhancer.cli import MODEL_ENV

ROOT = Path(__file__).resolve().parents[2]


def test_default_model_lookup_order(tmp_path, monkeypatch):
    monkeypatch.setenv(MODEL_ENV, str(tmp_path / "mine.onnx"))  # the command line's, not the runtime's
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


def test_the_command_line_reads_the_model_and_pool_switches_from_the_environment(tmp_path):
    """$TIM_ENHANCER_MODEL, $TIM_ENHANCER_FULL_STEPS and $TIM_ENHANCER_DEVICE_POOL are the defaults of
    --model, --full-steps and --device-pool: of the core's sub-commands and of the service's."""
    from enhancer.cli import build_parser, environment_defaults

    env = {MODEL_ENV: str(tmp_path / "mine.onnx"), "TIM_ENHANCER_FULL_STEPS": "1", "TIM_ENHANCER_DEVICE_POOL": "1"}
    assert environment_defaults(env) == {"model": env[MODEL_ENV], "full_steps": True, "device_pool": True}
    assert environment_defaults({}) == {"model": None, "full_steps": False, "device_pool": False}
    p = build_parser(env)
    assert p.parse_args(["denoise", "x.wav", "-o", "y.wav"]).model == env[MODEL_ENV]
    b = p.parse_args(["bench"])
    assert b.env_model == env[MODEL_ENV] and b.full_steps and b.device_pool
    assert not p.parse_args(["bench", "--no-full-steps"]).full_steps
    assert p.parse_args(["info"]).device_pool
    assert p.parse_args(["serve"]).model == env[MODEL_ENV]  # the service's sub-command (entry point)
    assert p.parse_args(["serve", "--model", "other.onnx"]).model == "other.onnx"
    step = p.parse_args(["step-server", "--address", str(tmp_path / "s.sock")])
    assert step.model == env[MODEL_ENV] and step.full_steps is True
    plain = build_parser({})
    assert plain.parse_args(["serve"]).model is None and not plain.parse_args(["bench"]).full_steps
    assert "TIM_ENHANCER_MODEL" in plain.format_help() and "TIM_ENHANCER_FULL_STEPS" in plain.format_help()


def test_pyproject_ships_the_model_as_package_data():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    st = cfg["tool"]["setuptools"]
    assert st["package-dir"]["enhancer.models"] == "models" and "enhancer.models" in st["packages"]
    assert {"tim.onnx", "upperband.npz"} <= set(st["package-data"]["enhancer.models"])  # the upper band's head beside it
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
    assert {"enhancer/models/tim.onnx", "enhancer/models/upperband.npz", "server/static/index.html", "training/quickstart.json",
            "enhancer/graphs/lane_writer.onnx", "enhancer/graphs/zero_rows.onnx"} <= names
    harness = [n for n in names if n.startswith(("tools/", "training/peers/"))]
    assert not harness, harness  # the test and benchmark tools run from a checkout, they are not shipped
    assert "License-Expression: MIT" in meta
    site = tmp_path / "site"
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert inst.returncode == 0, inst.stderr[-3000:]
    code = ("import numpy as np, enhancer; from enhancer.runtime import Enhancer; e = Enhancer.from_pretrained(); "
            "y = e.enhance(np.random.default_rng(0).standard_normal(16000).astype('float32') * 0.1, 16000); "
            "print(enhancer.__file__); print(e.engine.path); print(y.shape, bool(np.isfinite(y).all()), e.engine.upper_head is not None)")
    env = {k: v for k, v in os.environ.items() if k not in (MODEL_ENV, "PYTHONPATH")} | {"PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path / "dist", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    module, model, result = run.stdout.strip().splitlines()
    assert module.startswith(str(site)) and model == str(site / "enhancer" / "models" / "tim.onnx"), run.stdout
    assert result == "(16000,) True True"  # the head beside the installed model is found


def test_docker_context_leaves_the_harness_out():
    ignored = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")}
    assert {"tools", "training/peers", "tests"} <= ignored
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert not {"tools", "training.peers"} & set(cfg["tool"]["setuptools"]["packages"])


def test_license_file_is_mit():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) 2026 tim-enhancer contributors" in text
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == "MIT"


def _make(*args: str) -> str:
    r = subprocess.run(["make", "-n", *args], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.skipif(not shutil.which("make"), reason="no make here")
def test_make_serve_installs_only_the_serving_extras_once_and_make_test_adds_the_rest(tmp_path):
    """`make serve` installs extras cpu,serve (no torch) into the venv, `make test` adds train,dev
    to the same venv; each once: `make serve` after `make test` installs nothing."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    serving = cfg["dependencies"] + cfg["optional-dependencies"]["cpu"] + cfg["optional-dependencies"]["serve"]
    assert not [r for r in serving if r.split("=")[0].split("[")[0].lower() in ("torch", "onnx", "scipy", "pesq")]
    venv = f"VENV={tmp_path / 'venv'}"
    serve = _make("serve", venv)
    installs = [ln for ln in serve.splitlines() if "pip install" in ln and " -e " in ln]
    assert installs and all('".[cpu,serve]"' in ln for ln in installs), serve
    assert "enhancer serve --host" in serve and "http://127.0.0.1:8000/" in serve
    test = _make("test", venv, "NO_BROWSER_INSTALL=1")
    assert '-e ".[cpu,serve]"' in test and '-e ".[cpu,serve,train,dev]"' in test  # the serving set, then the rest
    assert test.count("-m venv") == 1  # one environment
    stamps = [ln.split()[-1] for ln in test.splitlines() if ln.startswith("touch ")]
    assert len(stamps) == 2
    Path(stamps[0]).parent.mkdir(parents=True)
    for s in stamps:  # what a real `make test` leaves behind
        Path(s).touch()
    assert "pip install" not in _make("serve", venv)  # after `make test`: nothing to install
    assert "pip install" not in _make("test", venv, "NO_BROWSER_INSTALL=1")


_NO_TORCH = """
import importlib.abc, sys
BLOCKED = ("torch", "torchaudio", "onnx", "training")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            print(f"BLOCKED IMPORT {name}", file=sys.stderr, flush=True)
            raise ImportError(f"{name} is blocked: the service must not need it")
        return None
sys.meta_path.insert(0, Block())
from enhancer.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_enhancer_serve_answers_healthz_without_torch(tmp_path):
    """What `make serve` runs, with torch (and onnx, training) unimportable: the service starts with
    the shipped model and answers /healthz and /readyz, and nothing tries to import them."""
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in (MODEL_ENV,)}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", _NO_TORCH, "serve", "--host", "127.0.0.1", "--port", str(port),
                                 "--device", "cpu", "--capacity", "4"], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=env)
    try:
        deadline, health = time.monotonic() + 120, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    health = (r.status, r.read())
                break
            except OSError:
                time.sleep(0.3)
        assert health is not None, log.read_text()[-3000:]
        assert health[0] == 200 and b'"ok"' in health[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as r:
            assert r.status == 200 and b'"ready":true' in r.read().replace(b" ", b"")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "BLOCKED IMPORT" not in text and "Traceback" not in text, text[-3000:]


_CLIENT_ONLY = """
import importlib.abc, sys
BLOCKED = ("torch", "onnx", "onnxruntime", "training", "fastapi", "uvicorn")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked: the client must not need it")
        return None
sys.meta_path.insert(0, Block())
import enhancer
from enhancer.client import Client, ClientError
from enhancer.cli import main
print(enhancer.__file__)
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_fresh_environment_has_the_client_and_the_browser_module(tmp_path, model_path):
    """The wheel installed (not editable) into a new virtual environment, run from outside the
    checkout: `enhancer stream --help` works; with torch, onnx, onnxruntime and the service's
    packages unimportable, `enhancer.client` imports and `enhancer stream` streams a file through a
    live service; the installed service serves /client.js as JavaScript and the examples. The
    environment takes its third-party packages from this one's site-packages (no index here)."""
    import site

    import soundfile as sf

    from tests.conftest import speechlike

    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True, cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("tim_enhancer-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert {"enhancer/client.py", "enhancer/client_stream.py", "enhancer/stream_command.py", "server/static/client.js",
            "server/static/examples/examples.json", "server/static/examples/noise-after.ogg"} <= names
    env = {k: v for k, v in os.environ.items() if k not in (MODEL_ENV, "PYTHONPATH", "VIRTUAL_ENV")}
    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python, enhancer_exe = venv / "bin" / "python", venv / "bin" / "enhancer"
    inst = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                           "--no-index", str(wheel)], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert inst.returncode == 0, inst.stderr[-3000:]
    assert enhancer_exe.is_file(), (inst.stdout, inst.stderr, sorted(p.name for p in (venv / "bin").iterdir()))
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies: this environment's site-packages, appended after the venv's own (their .pth
    # files, an editable install's among them, are not run)
    (Path(purelib) / "deps-from-the-test.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    work = tmp_path / "elsewhere"
    work.mkdir()

    def run(*argv):
        return subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=work, env=env, timeout=300)

    r = run(enhancer_exe, "stream", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: enhancer stream") and "--fast" in r.stdout, r.stderr
    x = speechlike(8000, 16000, seed=3)
    sf.write(work / "noisy.wav", x, 16000, subtype="PCM_16")
    from tests.server.conftest import TEST_LIMITS, LiveServer

    live = LiveServer(model=model_path, **TEST_LIMITS)
    try:
        r = run(python, "-c", _CLIENT_ONLY, "stream", "noisy.wav", "-o", "clean.wav", "--url", live.base, "--fast", "-q")
    finally:
        live.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == f"{purelib}/enhancer/__init__.py"  # the installed package, not the checkout
    assert sf.info(work / "clean.wav").frames == len(x)
    serve = ("from fastapi.testclient import TestClient; import server; c = TestClient(server.create_app()); "
             "r = c.get('/client.js'); e = c.get('/static/examples/examples.json'); "
             "print(r.status_code, r.headers['content-type'], 'export async function openStream' in r.text, "
             "e.status_code, len(e.json()), server.__file__)")
    r = run(python, "-c", serve)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[:6] == ["200", "text/javascript;", "charset=utf-8", "True", "200", "4"], r.stdout
    assert r.stdout.split()[-1].startswith(purelib)
