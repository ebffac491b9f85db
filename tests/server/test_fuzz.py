"""Bounded fuzzing in the default test run (the full campaign is `python -m tools.fuzz`), and
regression tests for what fuzzing found."""
from __future__ import annotations

import httpx

from tools.fuzz import Stats, fuzz_sessions, fuzz_uploads, run_schemathesis


def internal(srv) -> float:
    return srv.metrics.errors.labels(kind="internal")._value.get()


def test_fuzzed_uploads(live):
    """Hypothesis uploads (derandomized: the same cases every run): no 500, documented errors,
    valid audio enhanced completely."""
    stats, before = Stats(), internal(live)
    fuzz_uploads(live.base, 120, stats)
    assert stats.uploads >= 120 and stats.clean_uploads >= 2 and stats.status.get(200, 0) >= 20, stats.summary()
    assert len(stats.status) >= 4, stats.summary()  # errors of several kinds were exercised
    assert internal(live) == before
    live.wait_idle()


def test_fuzzed_websocket_sessions(live):
    stats, before = Stats(), internal(live)
    fuzz_sessions(live.base, 80, stats)
    assert stats.sessions >= 80 and stats.clean_sessions >= 5 and 1000 in stats.codes, stats.summary()
    assert internal(live) == before
    live.wait_idle()


def test_schemathesis(live):
    """The OpenAPI description against the live server: no 5xx, documented statuses, content
    types and headers, undeclared methods answered 405 with Allow."""
    assert run_schemathesis(live.base, max_examples=15, seed=1) == 0


# ---------------------------------------------------------------------------------- regressions
def test_undeclared_method_gets_405_with_allow(http):
    """schemathesis ST204: 405 came without the Allow header that RFC 9110 requires."""
    for method, path, allowed in (("TRACE", "/healthz", "GET"), ("PUT", "/v1/enhance", "POST"),
                                  ("DELETE", "/metrics", "GET")):
        r = http.request(method, path)
        assert r.status_code == 405 and allowed in r.headers["allow"], (method, path, r.headers)
        assert r.json()["error"]["kind"] == "method_not_allowed"


def test_file_field_without_filename_is_named_as_such(http):
    """fuzz: a multipart 'file' part without a filename arrives as a text value; the error now
    says so instead of claiming the field is missing."""
    body = (b'--b\r\nContent-Disposition: form-data; name="file"\r\n\r\nRIFF....\r\n--b--\r\n')
    r = http.post("/v1/enhance", content=body, headers={"Content-Type": "multipart/form-data; boundary=b"})
    assert r.status_code == 400 and "filename" in r.json()["error"]["message"], r.text


def test_vorbis_above_200_khz_is_refused_not_a_crash(tmp_path, model_path):
    """fuzz: writing OGG/Vorbis above 200 kHz segfaults libsndfile when the file is closed. One
    upload (a 384 kHz WAV with format=ogg, or an OGG whose header says 384 kHz) took the whole
    server down. Now 422 with advice; the server (in its own process here) stays up."""
    import io
    import socket
    import subprocess
    import sys
    import time

    import numpy as np
    import soundfile as sf

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([sys.executable, "-c", f"import server; server.run(port={port}, model={str(model_path)!r}, "
                             "device='cpu')"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        for rate, fmt in ((384000, "ogg"), (200001, "ogg")):
            b = io.BytesIO()
            sf.write(b, np.zeros((rate // 100, 1), np.float32), rate, format="WAV")
            r = httpx.post(base + f"/v1/enhance?format={fmt}", content=b.getvalue(),
                           headers={"Content-Type": "audio/wav"}, timeout=30)
            assert r.status_code == 422 and "format=wav" in r.json()["error"]["message"], r.text
        b = io.BytesIO()
        sf.write(b, np.zeros((2000, 1), np.float32), 200000, format="WAV")
        r = httpx.post(base + "/v1/enhance?format=ogg", content=b.getvalue(), headers={"Content-Type": "audio/wav"},
                       timeout=30)
        assert r.status_code == 200 and sf.info(io.BytesIO(r.content)).samplerate == 200000
        assert httpx.get(base + "/healthz", timeout=5).status_code == 200 and proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_huge_finite_samples_are_refused(http, live):
    """fuzz: a float WAV whose bytes were shifted by one decoded to finite values near 1e38; the
    model's output overflowed and a 200 carried NaN/Inf audio. Now such input is 422 / 1007 and
    loud but sane float audio still goes through."""
    import io
    import json

    import numpy as np
    import soundfile as sf
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    x = np.full((4000, 1), 1e30, np.float32)
    b = io.BytesIO()
    sf.write(b, x, 16000, format="WAV", subtype="FLOAT")
    r = http.post("/v1/enhance", content=b.getvalue(), headers={"Content-Type": "audio/wav"})
    assert r.status_code == 422 and r.json()["error"]["kind"] == "invalid_audio", r.text
    assert "sample values" in r.json()["error"]["message"]
    b = io.BytesIO()
    sf.write(b, 50 * np.random.default_rng(0).standard_normal((4000, 1)).astype(np.float32), 16000, format="WAV",
             subtype="FLOAT")
    r = http.post("/v1/enhance", content=b.getvalue(), headers={"Content-Type": "audio/wav"})
    assert r.status_code == 200
    y, _ = sf.read(io.BytesIO(r.content), dtype="float32")
    assert np.isfinite(y).all()
    with connect(live.ws_url) as ws:
        ws.send(json.dumps({"sample_rate": 16000, "encoding": "f32le"}))
        ws.recv(timeout=10)
        ws.send(x.astype("<f4").tobytes())
        msg = json.loads(ws.recv(timeout=10))
        try:
            while True:
                ws.recv(timeout=10)
        except ConnectionClosed:
            pass
    assert ws.close_code == 1007 and msg["kind"] == "invalid_audio"
