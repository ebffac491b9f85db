"""Security: the API key on every route, size caps enforced before the body is read, no client
path or name reaching the filesystem, no stack traces in errors."""
from __future__ import annotations

import io
import json
import os
import select
import socket
import struct
import sys
import time

import httpx
import numpy as np
import pytest
import soundfile as sf
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

import server
from server.api.auth import is_public
from server.settings import Settings
from tests.conftest import speechlike
from tools.rawws import OP_BINARY, OP_CONT, OP_TEXT, RawClient

from .conftest import TEST_LIMITS, LiveServer

KEY = "s3cret-key"


def _routes():
    """(path, methods, kind) of every route of the app, so a route added later is covered too."""
    def walk(routes):
        for r in routes:
            if hasattr(r, "path"):
                yield r
            elif hasattr(r, "original_router"):  # an included router (the service's have no prefix)
                yield from walk(r.original_router.routes)

    app = server.create_app(Settings.build())
    out = []
    for r in walk(app.routes):
        kind = "websocket" if "WebSocket" in type(r).__name__ else "http"
        methods = sorted(getattr(r, "methods", None) or {"GET"})
        out.append((r.path, methods, kind))
    return out


ROUTES = _routes()
PROTECTED = [r for r in ROUTES if not is_public(r[0].replace("{name}", "demo.js"))]


def wav(seconds=0.3, sr=16000) -> bytes:
    b = io.BytesIO()
    sf.write(b, speechlike(int(seconds * sr), sr, seed=2), sr, format="WAV", subtype="PCM_16")
    return b.getvalue()


def request(srv, path, method, headers=None, query=""):
    url = srv.base + path.replace("{name}", "demo.js") + query
    if method == "POST":
        return httpx.post(url, content=wav(), headers={"Content-Type": "audio/wav"} | (headers or {}), timeout=30)
    return httpx.request(method, url, headers=headers or {}, timeout=30)


# ---------------------------------------------------------------------------------- API key
def test_public_routes_are_only_health_and_the_demo_files():
    public = sorted(p for p, _, _ in ROUTES if is_public(p.replace("{name}", "demo.js")))
    assert public == ["/", "/client.js", "/healthz", "/readyz", "/static/examples/{name}", "/static/{name}"]
    assert {p for p, _, _ in PROTECTED} >= {"/v1/enhance", "/v1/stream", "/metrics", "/openapi.json", "/docs"}


@pytest.mark.parametrize("path,methods,kind", PROTECTED, ids=[r[0] for r in PROTECTED])
def test_api_key_enforced(live_auth, path, methods, kind):
    if kind == "websocket":
        for extra, code, error in ((None, 1008, "unauthorized"), ({"X-API-Key": "wrong"}, 1008, "forbidden")):
            with connect(live_auth.ws_url, additional_headers=extra) as ws:
                msg = json.loads(ws.recv(timeout=10))
                with pytest.raises(ConnectionClosed):
                    ws.recv(timeout=10)
            assert ws.close_code == code and msg["kind"] == error, (ws.close_code, msg)
        with connect(live_auth.ws_url, additional_headers={"X-API-Key": KEY}) as ws:
            ws.send('{"sample_rate": 16000}')
            assert json.loads(ws.recv(timeout=10))["type"] == "ready"
        return
    for method in methods:
        body = method != "HEAD"
        r = request(live_auth, path, method)
        assert r.status_code == 401 and (not body or r.json()["error"]["kind"] == "unauthorized"), (method, r.text[:200])
        r = request(live_auth, path, method, {"X-API-Key": "wrong"})
        assert r.status_code == 403 and (not body or r.json()["error"]["kind"] == "forbidden"), (method, r.text[:200])
        r = request(live_auth, path, method, {"X-API-Key": KEY})
        assert r.status_code == 200, (method, r.status_code, r.text[:300])
        if method == "GET":  # browsers: the query parameter
            assert request(live_auth, path, method, query=f"?api_key={KEY}").status_code == 200
            assert request(live_auth, path, method, query="?api_key=wrong").status_code == 403


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/", "/static/demo.js", "/client.js"])
def test_public_routes_need_no_key(live_auth, path):
    assert httpx.get(live_auth.base + path, timeout=10).status_code == 200


def test_key_in_query_is_refused_for_uploads(live_auth):
    r = httpx.post(live_auth.base + f"/v1/enhance?api_key={KEY}", content=wav(), headers={"Content-Type": "audio/wav"})
    assert r.status_code == 401


def test_unknown_paths_need_the_key_too(live_auth, http):
    assert httpx.get(live_auth.base + "/admin", timeout=10).status_code == 401
    r = httpx.get(live_auth.base + "/admin", headers={"X-API-Key": KEY}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["kind"] == "not_found"
    r = http.get("/v1/enhance")  # no auth server: wrong method
    assert r.status_code == 405 and r.json()["error"]["kind"] == "method_not_allowed"


def test_docs_with_query_key_fetch_the_schema_with_it(live_auth):
    page = httpx.get(live_auth.base + f"/docs?api_key={KEY}", timeout=10)
    assert page.status_code == 200 and f"/openapi.json?api_key={KEY}" in page.text
    assert httpx.get(live_auth.base + f"/openapi.json?api_key={KEY}", timeout=10).status_code == 200


def test_readiness_does_not_reveal_paths_or_secrets(live_auth):
    r = httpx.get(live_auth.base + "/readyz", timeout=10).json()
    text = json.dumps(r)
    assert KEY not in text and os.sep + "tmp" not in text and "model_path" not in r
    assert r["model_file"].endswith(".onnx") and os.sep not in r["model_file"]


# ---------------------------------------------------------------------------------- size caps
@pytest.fixture(scope="module")
def live_small(model_path):
    srv = LiveServer(model=model_path, **(TEST_LIMITS | dict(max_upload_bytes=1_000_000, max_message_bytes=50_000)))
    yield srv
    srv.stop()


def _http_head(sock, timeout=10.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_declared_oversize_upload_is_refused_before_the_body(live_small):
    """Content-Length over the cap: 413 without one byte of the body sent."""
    s = socket.create_connection(("127.0.0.1", live_small.port))
    s.sendall(b"POST /v1/enhance HTTP/1.1\r\nHost: x\r\nContent-Type: audio/wav\r\nContent-Length: 5000000000\r\n\r\n")
    head = _http_head(s)
    s.close()
    assert head.startswith(b"HTTP/1.1 413"), head[:200]


def _endless_upload(srv, head: bytes, chunk: bytes, limit_bytes: int):
    """Send `head` then chunked-encoded `chunk`s until the server answers (or `limit_bytes`).
    Returns (status line, bytes of body sent)."""
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.setblocking(False)
    s.sendall(head)
    piece = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    sent, answer = 0, b""
    pending = b""
    deadline = time.time() + 60
    while sent < limit_bytes and time.time() < deadline:
        readable, writable, _ = select.select([s], [s], [], 1.0)
        if readable:
            answer = s.recv(65536)
            break
        if writable:
            if not pending:
                pending = piece
            try:
                n = s.send(pending)
            except (BlockingIOError, ConnectionError):
                continue
            pending = pending[n:]
            sent += n
    s.close()
    return answer.split(b"\r\n", 1)[0], sent


def test_chunked_upload_over_the_cap_is_cut_off_while_streaming(live_small, monkeypatch):
    """No Content-Length, an endless chunked body: the server answers 413 while the client is
    still sending, having stored no more than the cap."""
    import server.api.rest as rest

    stored = {"bytes": 0}
    real = rest.tempfile.SpooledTemporaryFile

    class Counting(real):
        def write(self, data):
            stored["bytes"] += len(data)
            return super().write(data)

    monkeypatch.setattr(rest.tempfile, "SpooledTemporaryFile", Counting)
    cap = live_small.settings.max_upload_bytes
    head = b"POST /v1/enhance HTTP/1.1\r\nHost: x\r\nContent-Type: audio/wav\r\nTransfer-Encoding: chunked\r\n\r\n"
    status, sent = _endless_upload(live_small, head, b"\0" * 65536, 200 * cap)
    assert status == b"HTTP/1.1 413 Request Entity Too Large", status
    assert stored["bytes"] <= cap, stored
    assert sent < 100 * cap, f"the client could send {sent} bytes before the answer"


def test_chunked_multipart_over_the_cap_is_cut_off_while_streaming(live_small):
    cap = live_small.settings.max_upload_bytes
    head = (b"POST /v1/enhance HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: multipart/form-data; boundary=XyZ\r\n\r\n")
    first = (b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
             b"Content-Type: audio/wav\r\n\r\n")
    s_head = head + b"%x\r\n" % len(first) + first + b"\r\n"
    status, sent = _endless_upload(live_small, s_head, b"\1" * 65536, 200 * cap)
    assert status == b"HTTP/1.1 413 Request Entity Too Large", status
    assert sent < 100 * cap


def test_websocket_frame_over_the_cap_is_refused_from_its_header(live_small):
    """A frame announcing 1 GB: the JSON error and close 1009 without the payload ever being sent."""
    c = RawClient.connect("127.0.0.1", live_small.port, "/v1/stream")
    c.send_text('{"sample_rate": 16000}')
    c.recv_frame()
    c.send_raw(bytes([0x82, 0x80 | 127]) + struct.pack("!Q", 1 << 30) + os.urandom(4))  # header + mask only
    frames, code = c.recv_until_close()
    c.close()
    assert code == 1009, (code, frames)
    assert_too_large_json(frames, 1 << 30, live_small.settings.max_message_bytes)


def assert_too_large_json(frames, size: int, limit: int) -> None:
    """The documented answer: one JSON error `too_large` (code 1009) naming the size and the limit."""
    texts = [json.loads(p) for op, p in frames if op == OP_TEXT]
    assert len(texts) == 1 and texts[0]["type"] == "error" and texts[0]["kind"] == "too_large", frames
    assert texts[0]["code"] == 1009 and f"{size} bytes is over the limit of {limit} bytes" in texts[0]["message"], texts


def test_fragmented_message_over_the_cap_is_refused(live_small):
    """Continuation frames that add up to more than the cap: 1009 before the message ends."""
    c = RawClient.connect("127.0.0.1", live_small.port, "/v1/stream")
    c.send_text('{"sample_rate": 16000}')
    c.recv_frame()
    part = bytes(16_000)
    c.send_frame(OP_BINARY, part, fin=False)
    code = None
    try:
        for _ in range(200):  # up to 3.2 MB, never finished
            c.send_frame(OP_CONT, part, fin=False)
    except (ConnectionError, OSError):
        pass
    frames, code = c.recv_until_close()
    c.close()
    assert code == 1009, (code, frames)
    texts = [json.loads(p) for op, p in frames if op == OP_TEXT]
    assert [t["kind"] for t in texts] == ["too_large"] and "at least" in texts[0]["message"], frames


def test_message_over_the_cap_gets_the_json_error(live_small):
    with connect(live_small.ws_url, max_size=None) as ws:
        ws.send('{"sample_rate": 16000}')
        ws.recv(timeout=10)
        ws.send(bytes(live_small.settings.max_message_bytes + 2))
        msg = json.loads(ws.recv(timeout=10))
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    assert msg["kind"] == "too_large" and ws.close_code == 1009


# ---------------------------------------------------------------------------------- filesystem
MARKER = "zz-client-name-7f3a"


@pytest.fixture
def fs_spy(monkeypatch):
    """Every filesystem access of this process whose path contains MARKER: audit events (open,
    listdir, scandir, remove, rename, mkdir ...) and os.stat / os.lstat, which are not audited."""
    seen = []
    state = {"on": True}

    def hook(event, args):
        if state["on"] and event.split(".")[0] in ("open", "os", "shutil", "glob") and MARKER in repr(args):
            seen.append((event, repr(args)[:200]))

    sys.addaudithook(hook)  # audit hooks cannot be removed: this one is switched off below
    for name in ("stat", "lstat"):
        real = getattr(os, name)

        def spy(path, *a, _real=real, _name=name, **kw):
            if state["on"] and MARKER in str(path):
                seen.append((f"os.{_name}", str(path)))
            return _real(path, *a, **kw)

        monkeypatch.setattr(os, name, spy)
    yield seen
    state["on"] = False


def test_no_client_name_reaches_the_filesystem(live, http, fs_spy):
    data = wav()
    for filename in (f"../../{MARKER}.wav", f"/tmp/{MARKER}.wav", f"..\\..\\{MARKER}.wav", f"{MARKER}"):
        r = http.post("/v1/enhance", files={"file": (filename, data, "audio/wav")}, data={"format": "wav"})
        assert r.status_code == 200 and MARKER not in r.headers.get("content-disposition", "")
    r = http.post("/v1/enhance", files={"file": (f"{MARKER}.wav", data, "audio/wav")}, data={"format": MARKER})
    assert r.status_code == 422
    r = http.post(f"/v1/enhance?format={MARKER}", content=data, headers={"Content-Type": "audio/wav"})
    assert r.status_code == 422
    r = http.post("/v1/enhance", content=data, headers={"Content-Type": "audio/wav", "X-Filename": MARKER,
                                                       "Content-Disposition": f'attachment; filename="{MARKER}"'})
    assert r.status_code == 200
    for path in (f"/static/{MARKER}.js", f"/static/..%2f..%2f{MARKER}", f"/static/%2e%2e/{MARKER}",
                 f"/{MARKER}", f"/static/..%2F{MARKER}"):
        r = http.get(path)
        assert r.status_code == 404 and MARKER not in r.text, (path, r.status_code, r.text)
    for name in ("../app.py", "..%2Fapp.py", "%2e%2e%2fapp.py", "index.html/../../app.py"):
        r = http.get("/static/" + name)
        assert r.status_code == 404 and "create_app" not in r.text, name
    with connect(live.ws_url) as ws:
        ws.send(json.dumps({"sample_rate": 16000, "file": MARKER}))
        assert json.loads(ws.recv(timeout=10))["kind"] == "invalid_parameter"
    assert fs_spy == [], fs_spy


# ---------------------------------------------------------------------------------- error messages
TRACE_WORDS = ("Traceback", 'File "', ".py", "site-packages", "Error:", " object at 0x")


def assert_no_internals(text: str) -> None:
    for w in TRACE_WORDS:
        assert w not in text, (w, text[:500])


def test_internal_errors_carry_no_stack_trace(live, http, monkeypatch):
    import server.api.rest as rest
    import server.api.ws as ws_module

    def boom(*a, **k):
        raise ZeroDivisionError("secret internals at /work/main/server/x.py line 3")

    monkeypatch.setattr(rest, "AudioReader", boom)
    r = http.post("/v1/enhance", content=wav(), headers={"Content-Type": "audio/wav"})
    assert r.status_code == 500 and r.json() == {"error": {"kind": "internal", "message": "internal error"}}
    assert_no_internals(r.text)
    assert "secret" not in r.text
    monkeypatch.setattr(ws_module, "decode_pcm", boom)
    with connect(live.ws_url) as ws:
        ws.send('{"sample_rate": 16000}')
        ws.recv(timeout=10)
        ws.send(bytes(320))
        msg = ws.recv(timeout=10)
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    assert ws.close_code == 1011 and json.loads(msg)["kind"] == "internal"
    assert_no_internals(msg)
    assert "secret" not in msg


def test_client_errors_carry_no_internals(http):
    """The messages of every kind of bad upload: plain words, no paths, reprs or traces."""
    junk = np.random.default_rng(3).bytes(5000)
    cases = [(b"", "audio/wav"), (junk, "audio/wav"), (wav()[:300], "audio/wav"), (b"RIFF" + junk, "audio/wav"),
             (b"fLaC" + junk, "audio/flac"), (b"OggS" + junk, "audio/ogg"), (b"ID3" + junk, "audio/mpeg"),
             (wav(), "text/plain")]
    for body, ctype in cases:
        r = http.post("/v1/enhance", content=body, headers={"Content-Type": ctype})
        assert 400 <= r.status_code < 500, (ctype, r.status_code, r.text[:300])
        assert_no_internals(r.text)
    r = http.post("/v1/enhance", content=b"--b\r\nbroken", headers={"Content-Type": "multipart/form-data; boundary=b"})
    assert 400 <= r.status_code < 500
    assert_no_internals(r.text)
