"""TLS (server/README.md, "TLS"; deploy/README.md, "TLS at the edge"), with a self-signed certificate:
a websocket stream and an upload over wss and https through `enhancer serve --ssl-certfile
--ssl-keyfile`, and through HAProxy running deploy/haproxy.cfg in front of a plain server. The
`enhancer serve` process also carries a key file, rotated by SIGHUP while a stream of a removed key
runs on (its process is the one that receives the signal)."""
from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.conftest import speechlike
from tests.tls import certificate, with_certificate
from tools.launch import poll_ready, terminate

ROOT = Path(__file__).resolve().parents[2]
HAPROXY_CFG = ROOT / "deploy" / "haproxy.cfg"
SR = 16000
ALPHA, BETA, GAMMA = "alpha-key-0123456789abcdef", "beta-key-0123456789abcdef", "gamma-key-0123456789abcdef"
KEYS = '[[keys]]\nname = "alpha"\nkey = "{alpha}"\n\n[[keys]]\nname = "beta"\nkey = "{beta}"\nmax_streams = 2\n'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pcm(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


def wav(x: np.ndarray) -> bytes:
    b = io.BytesIO()
    sf.write(b, x, SR, format="WAV", subtype="PCM_16")
    return b.getvalue()


def receive_audio(ws, until_end: bool) -> tuple[int, dict | None]:
    """Samples received (16-bit mono) until the end message (or, without `until_end`, until none
    is waiting for 0.3 s), and the end message."""
    samples = 0
    while True:
        try:
            m = ws.recv(timeout=30 if until_end else 0.3)
        except TimeoutError:
            return samples, None
        if isinstance(m, bytes):
            samples += len(m) // 2
        elif json.loads(m)["type"] == "end":
            return samples, json.loads(m)
        else:
            assert json.loads(m)["type"] in ("late", "on_time"), m


def stream_and_upload(base: str, ctx, key: str | None = None) -> None:
    """A stream over wss and an upload over https to `base` (https://HOST:PORT): all audio back."""
    headers = {"X-API-Key": key} if key else {}
    x = speechlike(SR, SR, seed=7)
    with connect(base.replace("https", "wss", 1) + "/v1/stream", ssl=ctx, additional_headers=headers) as ws:
        ws.send(json.dumps({"sample_rate": SR}))
        assert json.loads(ws.recv(timeout=10))["type"] == "ready"
        for i in range(0, len(x), SR // 10):
            ws.send(pcm(x[i:i + SR // 10]))
        ws.send(json.dumps({"type": "end"}))
        samples, end = receive_audio(ws, until_end=True)
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    assert samples == end["samples"] == len(x) and ws.close_code == 1000
    r = httpx.post(base + "/v1/enhance", content=wav(x), headers={"Content-Type": "audio/wav"} | headers,
                   verify=ctx, timeout=60)
    assert r.status_code == 200 and r.headers["X-Frames"] == str(len(x)), r.text[:300]
    y, rate = sf.read(io.BytesIO(r.content))
    assert rate == SR and len(y) == len(x)


# ---------------------------------------------------------------------------------- enhancer serve
class Served:
    """`enhancer serve` with a certificate and a key file, in its own process (it gets the signals)."""

    def __init__(self, model: Path, tmp: Path):
        self.tls = certificate(tmp / "tls")
        self.keys, self.log_path, self.port = tmp / "keys.toml", tmp / "serve.log", free_port()
        self.keys.write_text(KEYS.format(alpha=ALPHA, beta=BETA))
        self.base = f"https://127.0.0.1:{self.port}"
        self.ctx = self.tls.client_context()
        exe = Path(sys.executable).with_name("enhancer")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "enhancer"]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.pop("TIM_ENHANCER_API_KEY", None)
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([*cmd, "serve", "--host", "127.0.0.1", "--port", str(self.port), "--model",
                                      str(model), "--device", "cpu", "--workers", "1", "--capacity", "4",
                                      "--drain-timeout-s", "1", "--api-keys", str(self.keys), "--ssl-certfile",
                                      str(self.tls.cert), "--ssl-keyfile", str(self.tls.key)],
                                     cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=self.log)
        if not poll_ready(self.proc, self.base, 120, verify=self.ctx):
            assert self.proc.poll() is None, f"enhancer serve exited: {self.log_text()[-2000:]}"
            raise AssertionError(f"enhancer serve not ready: {self.log_text()[-2000:]}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self, key: str) -> int:
        return httpx.get(self.base + "/openapi.json", headers={"X-API-Key": key}, verify=self.ctx, timeout=10).status_code

    def stop(self) -> None:
        terminate(self.proc)
        self.log.close()


@pytest.fixture(scope="module")
def served(model_path, tmp_path_factory):
    srv = Served(model_path, tmp_path_factory.mktemp("served"))
    yield srv
    srv.stop()


def test_enhancer_serve_streams_and_uploads_over_wss_and_https(served):
    stream_and_upload(served.base, served.ctx, BETA)
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port is no HTTP answer
        httpx.get(served.base.replace("https", "http", 1) + "/healthz", timeout=5)
    with pytest.raises(httpx.ConnectError):  # the client checks the certificate: unknown without the context
        httpx.get(served.base + "/healthz", timeout=5)
    assert "ready: demo at https://127.0.0.1" in served.log_text()
    assert "API keys: 2 name(s) from " in served.log_text() and "(alpha, beta); SIGHUP" in served.log_text()


def test_sighup_rotates_the_keys_while_a_stream_of_a_removed_key_runs_on(served):
    x = speechlike(SR, SR, seed=8)
    with connect(served.base.replace("https", "wss", 1) + "/v1/stream", ssl=served.ctx,
                 additional_headers={"X-API-Key": ALPHA}) as ws:
        ws.send(json.dumps({"sample_rate": SR}))
        assert json.loads(ws.recv(timeout=10))["type"] == "ready"
        ws.send(pcm(x[:SR // 2]))
        got, _ = receive_audio(ws, until_end=False)
        # alpha is removed and gamma added ("finish": alpha's stream runs to its end); then SIGHUP
        served.keys.write_text(KEYS.format(alpha=GAMMA, beta=BETA).replace('"alpha"', '"gamma"'))
        served.proc.send_signal(signal.SIGHUP)
        deadline = time.time() + 10
        while served.status(GAMMA) != 200 and time.time() < deadline:
            time.sleep(0.1)
        assert served.status(GAMMA) == 200 and served.status(ALPHA) == 403 and served.status(BETA) == 200
        ws.send(pcm(x[SR // 2:]))  # the stream of the removed key goes on and ends as usual
        ws.send(json.dumps({"type": "end"}))
        more, end = receive_audio(ws, until_end=True)
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    assert got + more == end["samples"] == len(x) and ws.close_code == 1000
    log = served.log_text()
    assert "SIGHUP: key file reloaded: 2 name(s) (gamma, beta), removed: alpha; 1 live stream(s) of removed keys " \
           "finish their session" in log
    # a malformed file: refused with its line named, the keys in force stay, the process too
    served.keys.write_text(KEYS.format(alpha=GAMMA, beta=BETA).replace("max_streams = 2", "max_streams = -2"))
    served.proc.send_signal(signal.SIGHUP)
    deadline = time.time() + 10
    while "not reloaded" not in served.log_text() and time.time() < deadline:
        time.sleep(0.1)
    line = next(i for i, ln in enumerate(served.keys.read_text().splitlines(), 1) if "-2" in ln)
    assert f"SIGHUP: the key file was not reloaded, the 2 key name(s) in force stay: keys.toml line {line}: key " \
           "entry 2: max_streams must be an integer >= 0, got -2" in served.log_text()
    assert served.proc.poll() is None and served.status(GAMMA) == 200 and served.status(BETA) == 200
    assert not any(k in served.log_text() for k in (ALPHA, BETA, GAMMA))


# ---------------------------------------------------------------------------------- HAProxy
def test_stream_and_upload_through_haproxy_over_tls(live, tmp_path):
    """deploy/haproxy.cfg (its TLS bind on a self-signed certificate, one server line pointed at a
    plain server): wss and https pass through it; TLS answers carry HSTS, plain ones do not."""
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.skip("haproxy is not installed (make test installs Debian's)")
    tls = certificate(tmp_path / "tls")
    plain, secure, stats = free_port(), free_port(), free_port()
    cfg = with_certificate(HAPROXY_CFG.read_text(), tls.pem, f"127.0.0.1:{secure}")
    cfg = re.sub(r"maxconn \d+", "maxconn 256", cfg).replace("bind :8000", f"bind 127.0.0.1:{plain}")
    cfg = cfg.replace("bind 127.0.0.1:8404", f"bind 127.0.0.1:{stats}")
    cfg = cfg.replace("log stdout format raw local0", "log stderr format raw local0 notice")
    cfg = re.sub(r"(\n[ \t]*server r1 )127\.0\.0\.1:\d+ agent-port \d+", rf"\g<1>127.0.0.1:{live.port} agent-port "
                 rf"{free_port()}", cfg)  # no agent there: weight 100, as deploy/README.md says
    cfg = re.sub(r"\n[ \t]*server (r[23]|s\d) [^\n]*", "", cfg)
    assert f":{live.port} " in cfg
    (tmp_path / "haproxy.cfg").write_text(cfg)
    log = open(tmp_path / "haproxy.log", "wb")
    proc = subprocess.Popen([haproxy, "-f", str(tmp_path / "haproxy.cfg")], stdout=log, stderr=log)
    try:
        deadline, state = time.time() + 30, None
        while time.time() < deadline and state != "UP":
            assert proc.poll() is None, (tmp_path / "haproxy.log").read_text()
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{stats}/;csv", timeout=2).read().decode()
                state = next(r["status"] for r in csv.DictReader(io.StringIO(text.lstrip("# "))) if r["svname"] == "r1")
            except OSError:
                pass
            time.sleep(0.2)
        assert state == "UP", state
        stream_and_upload(f"https://127.0.0.1:{secure}", tls.client_context())
        r = httpx.get(f"https://127.0.0.1:{secure}/healthz", verify=tls.client_context(), timeout=10)
        assert r.status_code == 200 and r.headers["strict-transport-security"].startswith("max-age=")
        r = httpx.get(f"http://127.0.0.1:{plain}/healthz", timeout=10)
        assert r.status_code == 200 and "strict-transport-security" not in r.headers
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
    live.wait_idle()


def test_a_certificate_that_does_not_load_stops_the_start(tmp_path, model_path):
    from server.serving import StartupError, check_tls
    from server.settings import Settings

    tls, other = certificate(tmp_path / "tls"), certificate(tmp_path / "other")
    check_tls(Settings.build(ssl_certfile=tls.cert, ssl_keyfile=tls.key))  # loads
    for cert, key, why in ((tmp_path / "none.pem", tls.key, "no such file or directory"),
                           (tls.key, tls.key, "key.pem holds no PEM certificate"),
                           (tls.cert, tls.cert, "cert.pem holds no PEM private key"),
                           (tls.cert, other.key, "the key is not the certificate's")):
        with pytest.raises(StartupError) as e:
            check_tls(Settings.build(ssl_certfile=cert, ssl_keyfile=key))
        assert str(e.value) == f"cannot load the TLS certificate {cert} with the key {key}: {why}"
    # `enhancer serve`: one line, no traceback, exit 2 (so for any invalid setting)
    exe = Path(sys.executable).with_name("enhancer")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "enhancer"]
    for args, words in ((["--ssl-certfile", str(tls.cert), "--ssl-keyfile", str(other.key)], "not the certificate's"),
                        (["--ssl-certfile", str(tls.cert)], "ssl_certfile and ssl_keyfile go together")):
        done = subprocess.run([*cmd, "serve", "--model", str(model_path), "--device", "cpu", "--capacity", "1", *args],
                              capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert done.returncode == 2 and done.stderr.startswith("error: ") and words in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
