"""A stream continued from its state over the websocket (start message "resume_bytes", the state in
binary messages, "ready" with "resumed"): the output goes on exactly where the state stopped; a
state of another model or format version starts the stream afresh ("resumed": null); a state that is not readable,
not sent as announced, or of another stream is refused with invalid_state and 1007."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.conftest import speechlike
from tests.server.test_ws import expect_close
from tests.tolerance import assert_close_to_peak

SR = 16000


def _state(enh, x, rate=SR, **options):
    s = enh.stream(rate, 1, **options)
    s.feed(x)
    blob = s.cursor.state_bytes()
    s.close()
    return blob


def _resume(url: str, blob: bytes, rest: np.ndarray, start: dict | None = None, piece: int = 200_000):
    """Open with the state (in binary messages of `piece` bytes: the test service's
    max_message_bytes), send `rest`, end: (ready message, output, messages, close code)."""
    out, texts = [], []
    with connect(url, max_size=None) as ws:
        ws.send(json.dumps({"sample_rate": SR, "encoding": "f32le", "resumable": True, "resume_bytes": len(blob)}
                           | (start or {})))
        for part in _in_messages(blob, piece):
            ws.send(part)
        ready = json.loads(ws.recv(timeout=10))
        assert ready["type"] == "ready", ready
        for i in range(0, len(rest), 1600):
            ws.send(rest[i:i + 1600].astype("<f4").tobytes())
        ws.send(json.dumps({"type": "end"}))
        try:
            while True:
                m = ws.recv(timeout=30)
                if isinstance(m, bytes):
                    out.append(np.frombuffer(m, "<f4"))
                else:
                    texts.append(json.loads(m))
        except ConnectionClosed:
            pass
        code = ws.close_code
    return ready, np.concatenate(out) if out else np.zeros(0, np.float32), texts, code


def test_a_stream_continues_from_its_state(live, enhancer_rt):
    x = speechlike(3 * SR, SR, seed=90)
    cut = int(1.3 * SR) + 11
    blob = _state(enhancer_rt, x[:cut])
    meta = json.loads(np.load(io.BytesIO(blob))["meta"].tobytes())
    at_in, at_out = meta["input_samples"], meta["output_samples"]
    assert at_in == cut and 0 < at_out < cut
    ready, y, texts, code = _resume(live.ws_url, blob, x[at_in:])
    assert ready["resumed"] == {"input_samples": at_in, "output_samples": at_out} and ready["resumable"] is True
    assert code == 1000 and texts[-1] == {"type": "end", "samples": len(x)}  # the counts go on
    assert len(y) == len(x) - at_out
    assert_close_to_peak(y, enhancer_rt.enhance(x, SR)[at_out:], rel=3e-4)


@pytest.mark.parametrize("change, why", [({"model": "0" * 32}, "another model"),
                                         ({"format": 99}, "another version")])
def test_a_state_of_another_model_or_version_starts_the_stream_afresh(live, enhancer_rt, change, why):
    x = speechlike(SR, SR, seed=91)
    blob = _state(enhancer_rt, x[:SR // 2])
    ready, y, texts, code = _resume(live.ws_url, _with_meta(blob, change), x)
    assert ready["resumed"] is None and why in ready["resume_refused"]
    assert code == 1000 and texts[-1] == {"type": "end", "samples": len(x)}
    assert_close_to_peak(y, enhancer_rt.enhance(x, SR), rel=3e-4)


def _announce(n, **start):
    return {"sample_rate": SR, "encoding": "f32le", "resumable": True, "resume_bytes": n} | start


def _in_messages(blob: bytes, size: int = 100_000) -> list[bytes]:
    """`blob` cut into binary messages of `size` bytes (the last one shorter)."""
    return [blob[i:i + size] for i in range(0, len(blob), size)]


def _with_meta(blob: bytes, change: dict, drop=()) -> bytes:
    """`blob` with its meta changed by `change` and without the keys `drop`."""
    with np.load(io.BytesIO(blob)) as z:
        arrays = {name: z[name] for name in z.files}
    meta = {k: v for k, v in (json.loads(arrays["meta"].tobytes()) | change).items() if k not in drop}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


@pytest.mark.parametrize("case", ["zero", "over", "text", "more", "garbage", "rate", "counts", "negative", "type"])
def test_a_state_that_cannot_be_used_is_refused_with_invalid_state(live, enhancer_rt, case):
    blob = _state(enhancer_rt, speechlike(SR // 2, SR, seed=92))
    limit = live.settings.max_state_bytes
    if case == "zero":
        expect_close(live.ws_url, [], 1007, "invalid_state", "resume_bytes", start=_announce(0))
    elif case == "over":
        expect_close(live.ws_url, [], 1007, "invalid_state", "max_state_bytes", start=_announce(limit + 1))
    elif case == "text":
        expect_close(live.ws_url, [blob[:1000], json.dumps({"type": "end"})], 1007, "invalid_state",
                     "binary messages", start=_announce(len(blob)))
    elif case == "more":
        longer = blob + b"\0" * 8
        expect_close(live.ws_url, _in_messages(longer), 1007,
                     "invalid_state", "binary messages", start=_announce(len(blob)))
    elif case == "garbage":
        expect_close(live.ws_url, [b"\x01" * 5000], 1007, "invalid_state", "not readable", start=_announce(5000))
    elif case == "rate":  # a 48 kHz stream's state given to a 16 kHz stream
        other = _state(enhancer_rt, speechlike(24000, 48000, seed=93), rate=48000)
        expect_close(live.ws_url, _in_messages(other), 1007,
                     "invalid_state", "sample_rate", start=_announce(len(other)))
    elif case in ("counts", "negative"):  # a meta without its sample counts, or with a negative one
        forged = _with_meta(blob, {"output_samples": -1}) if case == "negative" else _with_meta(blob, {}, ["input_samples"])
        expect_close(live.ws_url, _in_messages(forged), 1007,
                     "invalid_state", "input_samples" if case == "counts" else "output_samples",
                     start=_announce(len(forged)))
    else:
        expect_close(live.ws_url, [], 1007, "invalid_parameter", "resume_bytes", start=_announce("12"))
    # the service keeps serving
    x = speechlike(SR // 4, SR, seed=94)
    ready, y, _, code = _resume(live.ws_url, blob, x)
    assert code == 1000 and ready["resumed"]["input_samples"] == SR // 2 and len(y) > len(x)
