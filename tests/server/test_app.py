"""Operations endpoints, OpenAPI, settings, the scheduler's flush and the torch-free serving process."""
from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest

import server
from server.settings import Settings
from tests.conftest import speechlike

from .conftest import LiveServer


def test_health_and_readiness(http, enhancer_rt):
    assert http.get("/healthz").json() == {"status": "ok"}
    r = http.get("/readyz").json()
    assert r["ready"] is True and r["provider"] == "CPUExecutionProvider" and r["model"] == "tim"
    assert r["latency_ms"] == enhancer_rt.latency_ms and r["sample_rate"] == 16000
    assert r["limits"]["auth"] is False and "api_key" not in r["limits"]


def test_metrics_exposition(http):
    text = http.get("/metrics").text
    for name in ("tim_active_streams", "tim_frames_total", "tim_batch_size_bucket", "tim_step_seconds_bucket",
                 "tim_errors_total", "tim_rest_requests_total", "tim_lanes_in_use"):
        assert name in text, name


def test_openapi_describes_the_api(http):
    spec = http.get("/openapi.json").json()
    op = spec["paths"]["/v1/enhance"]["post"]
    content = op["requestBody"]["content"]
    assert {"audio/wav", "audio/flac", "audio/ogg", "audio/mpeg", "multipart/form-data"} <= set(content)
    assert content["multipart/form-data"]["schema"]["required"] == ["file"]
    params = {p["name"]: p for p in op["parameters"]}
    assert set(params) == {"atten_lim_db", "format", "band", "level"} and all(p["in"] == "query" for p in params.values())
    assert "full" in str(params["band"]) and "speech" in str(params["band"])
    assert "model" in str(params["level"]) and "input" in str(params["level"])
    assert {"400", "401", "403", "413", "415", "422", "503"} <= set(op["responses"])
    assert "audio/wav" in op["responses"]["200"]["content"]
    assert "X-API-Key" in str(spec["components"]["securitySchemes"])
    docs = http.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_demo_page_is_served(http):
    page = http.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for asset in ("/static/demo.js", "/static/style.css"):
        assert asset.split("/")[-1] in page.text
        assert http.get(asset).status_code == 200
    assert 'from "/client.js"' in http.get("/static/demo.js").text  # the page streams with the browser module


def test_the_browser_module_is_served_as_javascript_to_any_origin(http):
    r = http.get("/client.js", headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/javascript")
    assert r.headers["access-control-allow-origin"] == "*"
    assert "export async function openStream" in r.text and "export class EnhancedStream" in r.text
    assert "registerProcessor" in r.text  # its worklets travel with it


def test_rest_api_key(live_auth):
    with httpx.Client(base_url=live_auth.base, timeout=30) as c:
        import io

        import soundfile as sf

        b = io.BytesIO()
        sf.write(b, speechlike(4000, 16000), 16000, format="WAV")
        h = {"Content-Type": "audio/wav"}
        r = c.post("/v1/enhance", content=b.getvalue(), headers=h)
        assert r.status_code == 401 and r.json()["error"]["kind"] == "unauthorized"
        r = c.post("/v1/enhance", content=b.getvalue(), headers=h | {"X-API-Key": "wrong"})
        assert r.status_code == 403 and r.json()["error"]["kind"] == "forbidden"
        r = c.post("/v1/enhance", content=b.getvalue(), headers=h | {"X-API-Key": "s3cret-key"})
        assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
        assert c.get("/healthz").status_code == 200  # operations stay open


def test_rest_over_capacity(live_auth):
    """One enhancement slot: of several simultaneous long uploads some get 503, the rest succeed."""
    import io
    from concurrent.futures import ThreadPoolExecutor

    import soundfile as sf

    b = io.BytesIO()
    sf.write(b, speechlike(16000 * 6, 16000, seed=8), 16000, format="WAV")
    h = {"Content-Type": "audio/wav", "X-API-Key": "s3cret-key"}

    def post(_):
        return httpx.post(live_auth.base + "/v1/enhance", content=b.getvalue(), headers=h, timeout=60)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(post, range(4)))
    codes = sorted(r.status_code for r in results)
    assert 200 in codes and 503 in codes, codes
    busy = next(r for r in results if r.status_code == 503)
    assert busy.json()["error"]["kind"] == "over_capacity" and busy.headers["Retry-After"] == "1"
    live_auth.wait_idle()


def test_api_keys_are_redacted_from_logs():
    import logging

    from server.logs import RedactApiKey

    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, '%s - "WebSocket %s" [accepted]',
                               ("127.0.0.1:5", "/v1/stream?api_key=s3cret-key&x=1"), None)
    assert RedactApiKey().filter(record)
    assert "s3cret" not in record.getMessage() and "api_key=***&x=1" in record.getMessage()
    cfg = server.uvicorn_config(None, Settings.build()).log_config
    assert all("redact_api_key" in h["filters"] for h in cfg["handlers"].values())


def test_cors_setting(model_path):
    srv = LiveServer(model=model_path, device="cpu", cors_origins="https://app.example")
    try:
        h = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
        r = httpx.options(srv.base + "/v1/enhance", headers=h)
        assert r.headers.get("access-control-allow-origin") == "https://app.example"
        r = httpx.options(srv.base + "/v1/enhance", headers=h | {"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers
    finally:
        srv.stop()


def test_split_flush_matches_streaming_flush(enhancer_rt):
    """The scheduler's two-step flush equals StreamingEnhancer.flush (guards against drift)."""
    x = speechlike(30011, 44100, seed=2, channels=2)
    a, b = enhancer_rt.stream(44100, 2), enhancer_rt.stream(44100, 2)
    try:
        ya = np.concatenate([a.feed(x[:20000]), a.feed(x[20000:]), a.flush()])
        parts = [b.feed(x[:20000]), b.feed(x[20000:])]
        cb = b.cursor
        cb.begin_flush()
        while n := cb.ready_hops():  # the tail in one multi-frame call, as the scheduler runs it
            r = b.pool.run(b.lanes, cb.take_hops(n), np.zeros(2, np.float32))
            cb.put_outputs(r.out, r.competition, r.activity)
        parts.append(cb.end_flush())
        yb = np.concatenate(parts)
    finally:
        a.close()
        b.close()
    assert yb.shape == x.shape
    np.testing.assert_array_equal(ya, yb)


def test_settings_validation(monkeypatch):
    with pytest.raises(ValueError, match="unknown setting"):
        Settings.build(max_stream=3)
    with pytest.raises(ValueError, match="workers"):
        Settings.build(workers=0)
    with pytest.raises(ValueError, match="device"):
        Settings.build(device="tpu")
    monkeypatch.setenv("TIM_ENHANCER_API_KEY", "from-env")
    monkeypatch.setenv("TIM_ENHANCER_CORS_ORIGINS", "https://a.example, https://b.example")
    s = Settings.build()
    assert s.api_key == "from-env" and s.cors_origins == ("https://a.example", "https://b.example")
    assert Settings.build(api_key="explicit").api_key == "explicit"


def test_run_reports_model_and_device_problems_plainly(tmp_path, model_path):
    from enhancer.errors import CheckpointError

    with pytest.raises(CheckpointError, match="model file not found"):
        server.run(model=tmp_path / "nope.onnx")
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"not a model at all")
    with pytest.raises(CheckpointError, match="cannot load model"):
        server.run(model=corrupt, port=1)
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(RuntimeError, match="CUDAExecutionProvider"):
            server.run(model=model_path, device="cuda", port=1)


def test_enhancer_serve_dispatches_to_the_service(tmp_path, capsys):
    """`enhancer serve` is the service's sub-command (server.cli, found through an entry point)."""
    from enhancer.cli import main

    assert main(["serve", "--model", str(tmp_path / "nope.onnx"), "--port", "1"]) == 2
    assert "model file not found" in capsys.readouterr().err


def test_serving_process_does_not_import_torch(model_path):
    code = ("import sys, server, server.api.app, server.api.rest, server.api.ws, server.scheduling.scheduler, tools.loadtest; "
            f"from server.settings import Settings; app = server.create_app(Settings.build(model={str(model_path)!r})); "
            "from server.scheduling.scheduler import Scheduler; s = Scheduler(app.state.settings, app.state.metrics); s.start(); "
            "s.stop(); assert 'torch' not in sys.modules, 'torch was imported'; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
