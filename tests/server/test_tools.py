"""The reliability tools themselves: a short soak against the live server writes consistent
figures, a table and a plot; the audit covers the serving closure and nothing else."""
from __future__ import annotations

import json
import os

import soundfile as sf

from tests.conftest import speechlike
from tools import audit, soak


def test_short_soak_writes_figures_table_and_plot(live, tmp_path):
    wav = tmp_path / "speech.wav"
    sf.write(wav, speechlike(16000 * 3, 16000, seed=70), 16000, subtype="PCM_16")
    out = tmp_path / "soak"
    soak.main(["--streams", "2", "--minutes", "0.1", "--cycles", "40", "--sample-s", "0.5", "--file", str(wav),
               "--url", live.ws_url, "--server-pid", str(os.getpid()), "--out", str(out)])
    r = json.loads((out / "soak.json").read_text())
    expected = 2 * 6.0 / 0.02  # streams x seconds / chunk: one output message per chunk or more
    assert r["messages"] >= 0.8 * expected and r["complete"] and not r["client_errors"], {k: r[k] for k in (
        "messages", "complete", "client_errors")}
    assert r["late"] == sum(w["late"] for w in r["windows"])
    assert len(r["samples"]) >= 8 and all(s["rss_mb"] > 0 and s["fds"] > 0 for s in r["samples"])
    assert r["rss"]["base_mb"] > 0 and r["rss"]["growth_pct"] is not None
    assert r["cycles"]["cycles"] == 40 and r["cycles"]["fd_growth"] <= 2
    table = (out / "soak.md").read_text()
    assert "late messages" in table and "connect/disconnect cycles" in table
    assert (out / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    live.wait_idle()


def test_audit_closure_is_the_serving_stack():
    packages = audit.closure()
    assert {"fastapi", "uvicorn", "starlette", "onnxruntime", "numpy", "soundfile", "websockets"} <= set(packages)
    assert not {"torch", "hypothesis", "schemathesis", "matplotlib", "pytest"} & set(packages)


def test_soak_windows_add_up_to_the_totals_when_tails_arrive_late():
    """A loaded machine delivers the last messages after the nominal end: they stay in a window."""
    from types import SimpleNamespace

    client = SimpleNamespace(arrivals=[0.1, 5.9, 6.3, 6.9, 7.6], latencies=[0.05, 0.2, 0.3, 0.5, 0.9])
    w = soak.windows([client], 0.0, 6.0, 0.5, budget_ms=100.0)
    assert sum(x["messages"] for x in w) == 5 and sum(x["late"] for x in w) == 4
    assert w[-1]["t"] + 0.5 > 7.6


def test_gpu_check_rehearses_on_the_cpu(model_path, tmp_path, monkeypatch):
    """`tools.gpu_check` on the CPU, with the device pool that CUDA would use: the parity
    stages (lane ranges, and full-pool live steps) pass and land in the JSON with the environment."""
    from tools import gpu_check

    for name in ("TIM_ENHANCER_DEVICE_POOL", "TIM_ENHANCER_FULL_STEPS"):
        monkeypatch.delenv(name, raising=False)  # the switches are flags, passed down: none from the environment
    assert gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--quick", "--model", str(model_path),
                           "--skip", "info,bench,load,profile,bench_full", "--full-steps", "--device-pool"]) == 0
    assert "TIM_ENHANCER_FULL_STEPS" not in os.environ  # gpu_check no longer sets it for later pools
    r = json.loads((tmp_path / "gpu-check.json").read_text())
    assert r["environment"]["providers"] and r["device"] == "cpu"
    for stage in ("parity", "parity_full"):
        p = r[stage][model_path.name]
        assert p["ok"] and p["streams"] == 8 and p["worst_stream_max_rel_diff"] <= 1e-4, p
    assert r["parity"][model_path.name]["pool"] == "DeviceLanePool"
    assert r["parity_full"][model_path.name]["pool"] == "DeviceLanePool (full-pool live steps)"
