"""Named API keys from a key file (server/README.md, "API keys"): the file's format and its errors
(each naming the line), per-key limits on live streams, REST requests and upload length against a
live service with three keys, per-key metrics labelled by name, and rotation by POST
/v1/admin/reload (SIGHUP, TLS and `enhancer serve` itself: tests/server/test_tls.py)."""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
import soundfile as sf
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from server.api.admin import REMOVED_MESSAGE
from server.api.keyfile import KeyFileError, KeyRing, digest, load_key_file
from server.settings import Settings
from tests.conftest import speechlike

from .conftest import TEST_LIMITS, LiveServer

ROOT = Path(__file__).resolve().parents[2]
SR = 16000
ALPHA, BETA, OPS = "alpha-key-0123456789abcdef", "beta-key-0123456789abcdef", "ops-key-0123456789abcdef"
SECRETS = (ALPHA, BETA, OPS)


def sha256(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


# alpha: one stream at once, two requests a minute; beta (written as its hash): three streams, uploads
# of half a second; ops: admin, no limits of its own
KEYS_TOML = f"""
[[keys]]
name = "alpha"
key = "{ALPHA}"
max_streams = 1
requests_per_minute = 2

[[keys]]
name = "beta"
key = "{sha256(BETA)}"
max_streams = 3
max_upload_s = 0.5

[[keys]]
name = "ops"
key = "{OPS}"
admin = true
"""


def wav(seconds: float) -> bytes:
    b = io.BytesIO()
    sf.write(b, speechlike(int(seconds * SR), SR, seed=3), SR, format="WAV", subtype="PCM_16")
    return b.getvalue()


def upload(srv, key: str, seconds: float = 0.3) -> httpx.Response:
    return httpx.post(srv.base + "/v1/enhance", content=wav(seconds), timeout=60,
                      headers={"Content-Type": "audio/wav", "X-API-Key": key})


@contextmanager
def start_stream(srv, key: str):
    """An open stream of `key`, past its ready message."""
    with connect(srv.ws_url, additional_headers={"X-API-Key": key}) as ws:
        ws.send(json.dumps({"sample_rate": SR}))
        msg = json.loads(ws.recv(timeout=10))
        assert msg["type"] == "ready", msg
        yield ws


def refused_stream(srv, key: str) -> tuple[dict, int, str]:
    """The error, close code and close reason of a stream refused at the handshake."""
    with connect(srv.ws_url, additional_headers={"X-API-Key": key}) as ws:
        msg = json.loads(ws.recv(timeout=10))
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    return msg, ws.close_code, ws.close_reason


def sample(srv, name: str, **labels) -> float | None:
    return srv.metrics.registry.get_sample_value(name, labels)


def wait_for(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (ok := check()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return ok


# ---------------------------------------------------------------------------------- the file
def readme_example() -> str:
    text = (ROOT / "server" / "README.md").read_text()
    return re.search(r"^## API keys\n.*?^```toml\n(.*?)^```", text, re.S | re.M).group(1)


def test_the_readme_example_loads_as_toml_and_as_json(tmp_path):
    (tmp_path / "keys.toml").write_text(readme_example())
    ring = load_key_file(tmp_path / "keys.toml")
    assert ring.names == ["app-a", "app-b", "ops"] and ring.removed_streams == "finish"
    a, b, ops = ring.keys
    assert (a.max_streams, a.requests_per_minute, a.max_upload_s, a.admin) == (4, 60, 600, False)
    assert len(b.digests) == 2 and ops.admin and ops.max_streams is None  # b: the old and the new key
    doc = {"removed_streams": "finish", "keys": [
        {"name": k.name, "keys": ["sha256:" + d.hex() for d in k.digests], "admin": k.admin}
        | {f: getattr(k, f) for f in ("max_streams", "requests_per_minute", "max_upload_s") if getattr(k, f)}
        for k in ring.keys]}
    (tmp_path / "keys.json").write_text(json.dumps(doc, indent=2))
    assert load_key_file(tmp_path / "keys.json") == ring
    # a file without a known suffix: JSON when it opens with "{"
    (tmp_path / "keys").write_text(json.dumps(doc))
    assert load_key_file(tmp_path / "keys") == ring


def test_keys_are_held_and_compared_as_digests(tmp_path):
    (tmp_path / "k.toml").write_text(KEYS_TOML)
    ring = load_key_file(tmp_path / "k.toml")
    for secret, name in zip(SECRETS, ("alpha", "beta", "ops")):  # plain or sha256: in the file, alike
        entry, d = ring.find(secret)
        assert entry.name == name and d == digest(secret) == hashlib.sha256(secret.encode()).digest()
    assert ring.find("not-a-key-0123456789")[0] is None and ring.find(ALPHA[:-1])[0] is None
    held = repr(ring) + repr([vars(k) for k in ring.keys])
    assert not any(s in held for s in SECRETS)
    assert ring.digests == {digest(s) for s in SECRETS}
    assert KeyRing.single(ALPHA).find(ALPHA)[0].name == "default"


MALFORMED = [  # (file name, text, the line named, words of the error)
    ("k.toml", '[[keys]]\nname = "a"\nkey = "x\n', "line 3, column", "malformed TOML"),
    ("k.toml", f'[[keys]]\nname = "a"\nkey = "{ALPHA}"\n\n[[keys]]\nname = "b"\nkey = "{BETA}"\nmax_streams = -1\n',
     "line 8", "key entry 2: max_streams must be an integer >= 0, got -1"),
    ("k.toml", f'[[keys]]\nname = "a"\nkey = "{ALPHA}"\nmax_stream = 2\n', "line 4", "unknown field 'max_stream'"),
    ("k.toml", f'[[keys]]\nname = "a"\nkey = "{ALPHA}"\n[[keys]]\nname = "a"\nkey = "{BETA}"\n', "line 5",
     "the name 'a' is used by key entry 1 too"),
    ("k.toml", f'[[keys]]\nname = "a"\nkey = "{ALPHA}"\n[[keys]]\nname = "b"\nkey = "{sha256(ALPHA)}"\n', "line 6",
     "also key entry 1's"),
    ("k.toml", '[[keys]]\nname = "a"\n\nkey = "short"\n', "line 4", "at least 16 characters"),
    ("k.toml", '[[keys]]\nname = "a"\nkey = "sha256:abc"\n', "line 3", "64 hex digits"),
    ("k.toml", f'[[keys]]\nname = "a b"\nkey = "{ALPHA}"\n', "line 2", "name must be"),
    ("k.toml", f'[[keys]]\nname = "a"\nkey = "{ALPHA}"\nrequests_per_minute = "many"\n', "line 4",
     "requests_per_minute must be a number"),
    ("k.toml", f'removed_streams = "kill"\n[[keys]]\nname = "a"\nkey = "{ALPHA}"\n', "line 1", "removed_streams"),
    ("k.toml", "# no keys\n", None, "at least one key"),
    ("k.json", '{"keys": [\n  {"name": "a" "key": 1}\n]}', "line 2, column", "malformed JSON"),
    ("k.json", f'{{"keys": [\n  {{"name": "a", "key": "{ALPHA}"}},\n  {{"name": "b",\n   "key": "short"}}\n]}}',
     "line 4", "key entry 2: a key must have at least 16 characters"),
    ("k.json", f'{{"keys": [{{"name": "a", "key": "{ALPHA}",\n "admin": "yes"}}]}}', "line 2", "admin must be true"),
]


@pytest.mark.parametrize("name,text,line,words", MALFORMED, ids=[f"{m[0]}-{i}" for i, m in enumerate(MALFORMED)])
def test_a_malformed_file_is_refused_naming_the_line(tmp_path, name, text, line, words):
    (tmp_path / name).write_text(text)
    with pytest.raises(KeyFileError) as e:
        load_key_file(tmp_path / name)
    message = str(e.value)
    assert message.startswith(name) and words in message, message
    assert (f"{name} {line}" in message) if line else " line " not in message, message
    assert not any(s in message for s in SECRETS) and "short" not in message  # never a key in an error


def test_a_file_that_cannot_be_read_is_named(tmp_path):
    with pytest.raises(KeyFileError, match="missing.toml: cannot read the key file"):
        load_key_file(tmp_path / "missing.toml")
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe")
    with pytest.raises(KeyFileError, match="not UTF-8"):
        load_key_file(tmp_path / "bin.toml")


def test_settings_and_command_line(monkeypatch, tmp_path):
    from server.cli import add_serve

    monkeypatch.delenv("TIM_ENHANCER_API_KEY", raising=False)
    monkeypatch.setenv("TIM_ENHANCER_API_KEYS_FILE", str(tmp_path / "keys.toml"))
    s = Settings.build()
    assert s.api_keys_file == tmp_path / "keys.toml" and s.public()["auth"] is True
    assert Settings.build(api_keys_file="other.json").api_keys_file == Path("other.json")  # the argument wins
    with pytest.raises(ValueError, match="api_key and api_keys_file are both set"):
        Settings.build(api_key=ALPHA)
    monkeypatch.delenv("TIM_ENHANCER_API_KEYS_FILE")
    with pytest.raises(ValueError, match="ssl_certfile and ssl_keyfile go together"):
        Settings.build(ssl_certfile="cert.pem")
    top = argparse.ArgumentParser()
    add_serve(top.add_subparsers(dest="command"))
    a = top.parse_args(["serve", "--api-keys", "keys.toml", "--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem"])
    assert (a.api_keys, a.ssl_certfile, a.ssl_keyfile) == ("keys.toml", "c.pem", "k.pem")
    # a malformed key file stops the start with the line named (`enhancer serve` prints it: error: ...)
    (tmp_path / "bad.toml").write_text("[[keys]]\nname = 'a'\nkey = 'short'\n")
    import server

    with pytest.raises(KeyFileError, match="bad.toml line 3"):
        server.create_app(Settings.build(device="cpu", workers=1, api_keys_file=tmp_path / "bad.toml"))


# ---------------------------------------------------------------------------------- limits, live
def keyed_server(model_path, folder: Path) -> LiveServer:
    """A live server on KEYS_TOML (written to `folder`; the file is `srv.keys_file`)."""
    path = folder / "keys.toml"
    path.write_text(KEYS_TOML)
    srv = LiveServer(model=model_path, **(TEST_LIMITS | dict(api_keys_file=path, capacity=4, max_streams=4,
                                                            idle_timeout_s=30.0)))
    srv.keys_file = path
    return srv


@pytest.fixture(scope="module")
def keyed(model_path, tmp_path_factory):
    srv = keyed_server(model_path, tmp_path_factory.mktemp("keys"))
    yield srv
    srv.stop()


def test_stream_limits_per_key(keyed):
    """alpha at its limit of one stream is refused (1013, its limit named) while beta and ops open
    theirs; once the machine is full, beta (below its own limit) is refused for the capacity."""
    srv = keyed
    before = {r: sample(srv, "tim_key_refused_total", key_name=n, reason=r) for n, r in (("alpha", "streams"),
                                                                                          ("beta", "capacity"))}
    with ExitStack() as held:
        held.enter_context(start_stream(srv, ALPHA))
        msg, code, reason = refused_stream(srv, ALPHA)
        assert code == 1013 and msg["kind"] == "key_limit" and msg["code"] == 1013, msg
        assert msg["retry_after_s"] == 5 and msg["limit"] == "max_streams" and msg["max_streams"] == 1
        assert "API key's limit of 1 live stream" in reason and "max_streams" in reason and "capacity" not in reason
        # another key is not refused while the machine has room
        for key in (BETA, BETA, OPS):
            held.enter_context(start_stream(srv, key))
        assert srv.scheduler.admission.streams == 4
        msg, code, reason = refused_stream(srv, BETA)  # 2 of its 3: the machine's capacity refuses it
        assert code == 1013 and msg["kind"] == "over_capacity" and "capacity" in reason and "API key" not in reason
        assert sample(srv, "tim_key_active_streams", key_name="alpha") == 1
        assert sample(srv, "tim_key_active_streams", key_name="beta") == 2
        assert sample(srv, "tim_key_refused_total", key_name="alpha", reason="streams") == before["streams"] + 1
        assert sample(srv, "tim_key_refused_total", key_name="beta", reason="capacity") == before["capacity"] + 1
    assert wait_for(lambda: all(sample(srv, "tim_key_active_streams", key_name=n) == 0 for n in ("alpha", "beta", "ops")))
    with start_stream(srv, ALPHA):  # its slot is free again
        pass
    srv.wait_idle()


def test_request_rate_and_upload_length_per_key(keyed):
    srv = keyed
    for _ in range(2):
        r = upload(srv, ALPHA)
        assert r.status_code == 200, r.text
    r = upload(srv, ALPHA)  # over 2 a minute: 429 with Retry-After, before the body is read
    err = r.json()["error"]
    assert r.status_code == 429 and err["kind"] == "rate_limited" and err["limit"] == "requests_per_minute", r.text
    assert 20 <= int(r.headers["Retry-After"]) <= 30 and 20 <= err["retry_after_s"] <= 30
    assert "limit of 2 requests per minute" in err["message"]
    # beta's own limit is half a second of audio per upload; ops has the server's (30 s)
    assert upload(srv, BETA, 0.3).status_code == 200
    r = upload(srv, BETA, 1.0)
    err = r.json()["error"]
    assert r.status_code == 413 and err["kind"] == "too_long" and err["limit"] == "max_upload_s", r.text
    assert "the audio is 1.0 s long; this API key's limit (max_upload_s) is 0.5 s" in err["message"]
    assert upload(srv, OPS, 1.0).status_code == 200
    assert sample(srv, "tim_key_requests_total", key_name="alpha", status="200") == 2
    assert sample(srv, "tim_key_requests_total", key_name="alpha", status="429") == 1
    assert sample(srv, "tim_key_requests_total", key_name="beta", status="413") == 1
    assert sample(srv, "tim_key_refused_total", key_name="alpha", reason="requests") == 1
    assert sample(srv, "tim_key_refused_total", key_name="beta", reason="upload_length") == 1
    assert sample(srv, "tim_key_audio_seconds_total", key_name="beta", source="rest") == pytest.approx(0.3)
    assert sample(srv, "tim_key_audio_seconds_total", key_name="ops", source="rest") == pytest.approx(1.0)
    srv.wait_idle()


def test_metrics_are_for_admin_keys_and_name_keys_by_name(keyed):
    srv = keyed
    with start_stream(srv, BETA) as ws:
        ws.send((speechlike(SR // 2, SR, seed=4) * 32767).astype("<i2").tobytes())
        ws.send(json.dumps({"type": "end"}))
        while isinstance(m := ws.recv(timeout=10), bytes) or json.loads(m)["type"] != "end":
            pass
    r = httpx.get(srv.base + "/metrics", headers={"X-API-Key": ALPHA}, timeout=10)
    assert r.status_code == 403 and "admin" in r.json()["error"]["message"]
    r = httpx.post(srv.base + "/v1/admin/reload", headers={"X-API-Key": BETA}, timeout=10)
    assert r.status_code == 403 and "admin" in r.json()["error"]["message"]
    assert httpx.post(srv.base + "/v1/admin/reload", timeout=10).status_code == 401
    text = httpx.get(srv.base + f"/metrics?api_key={OPS}", timeout=10).text
    assert 'tim_key_streams_total{key_name="beta"}' in text and "tim_api_keys 3.0" in text
    assert 'tim_key_audio_seconds_total{key_name="beta",source="stream"} 0.5' in text
    assert not any(s in text or hashlib.sha256(s.encode()).hexdigest() in text for s in SECRETS)


# ---------------------------------------------------------------------------------- rotation
@pytest.fixture(scope="module")
def rotating(model_path, tmp_path_factory):
    srv = keyed_server(model_path, tmp_path_factory.mktemp("rotating"))
    yield srv
    srv.stop()


def reload(srv, text: str | None = None) -> httpx.Response:
    if text is not None:
        srv.keys_file.write_text(text)
    return httpx.post(srv.base + "/v1/admin/reload", headers={"X-API-Key": OPS}, timeout=10)


def test_reload_closes_the_streams_of_a_removed_key_when_the_file_says_so(rotating):
    srv = rotating
    assert reload(srv, KEYS_TOML).status_code == 200
    with start_stream(srv, ALPHA) as ws:
        ws.send((speechlike(SR // 5, SR, seed=5) * 32767).astype("<i2").tobytes())
        new = KEYS_TOML.replace(f'name = "alpha"\nkey = "{ALPHA}"', 'name = "alpha2"\nkey = "alpha2-key-0123456789abc"')
        r = reload(srv, 'removed_streams = "close"\n' + new)
        assert r.status_code == 200, r.text
        assert r.json() == {"reloaded": True, "keys": ["alpha2", "beta", "ops"], "removed": ["alpha"],
                            "removed_streams": "close", "streams_of_removed_keys": 1}
        while isinstance(m := ws.recv(timeout=10), bytes):  # output already on its way, then the error
            pass
        err = json.loads(m)
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    assert err["kind"] == "forbidden" and err["message"] == REMOVED_MESSAGE and ws.close_code == 1008
    assert ws.close_reason == REMOVED_MESSAGE
    msg, code, _ = refused_stream(srv, ALPHA)  # the old key is refused from now on, the new one works
    assert code == 1008 and msg["kind"] == "forbidden"
    with start_stream(srv, "alpha2-key-0123456789abc"):
        pass
    assert sample(srv, "tim_api_keys") == 3 and sample(srv, "tim_key_reloads_total", result="ok") >= 2
    srv.wait_idle()


def test_a_malformed_file_is_refused_and_the_old_keys_stay(rotating):
    srv = rotating
    assert reload(srv, KEYS_TOML).status_code == 200
    errors = sample(srv, "tim_key_reloads_total", result="error")
    r = reload(srv, KEYS_TOML.replace("max_streams = 3", "max_streams = three"))
    err = r.json()["error"]
    line = KEYS_TOML.splitlines().index("max_streams = 3") + 1
    assert r.status_code == 422 and err["kind"] == "invalid_key_file", r.text
    assert err["message"].startswith(f"keys.toml line {line}, column") and "the keys in force were kept" in err["message"]
    assert sample(srv, "tim_key_reloads_total", result="error") == errors + 1
    # the keys in force stay, limits included
    with start_stream(srv, ALPHA):
        assert refused_stream(srv, ALPHA)[0]["kind"] == "key_limit"
    assert upload(srv, BETA, 0.3).status_code == 200
    srv.keys_file.write_text(KEYS_TOML)
    srv.wait_idle()
