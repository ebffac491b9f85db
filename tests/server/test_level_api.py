"""The output level option through the service: REST `level=input` (query or form field) and the
websocket start field `"level": "input"` give what `Enhancer.enhance(..., level="input")` gives;
the default is the model's level; a level that does not exist is refused by name."""
from __future__ import annotations

import numpy as np
import pytest

from tests.server.test_rest import assert_error, decode, encode, expected, signal, wav_bytes
from tests.server.test_ws import expect_close, random_chunks, stream_through
from tests.tolerance import assert_close_to_peak, assert_differs


@pytest.mark.parametrize("sr,channels", [(16000, 1), (48000, 2)])
def test_rest_level_query_and_form_field(http, enhancer_rt, sr, channels):
    data = encode(signal(sr, channels, seconds=1.5, seed=21), sr, "WAV", "FLOAT")
    model, _ = expected(enhancer_rt, data)
    restored, _ = expected(enhancer_rt, data, level="input")
    assert_differs(restored, model)
    r = http.post("/v1/enhance", params={"level": "input"}, content=data, headers={"Content-Type": "audio/wav"})
    assert r.status_code == 200, r.text
    assert_close_to_peak(decode(r.content)[0], restored)
    r = http.post("/v1/enhance", files={"file": ("x.wav", data, "audio/wav")}, data={"level": "input"})
    assert r.status_code == 200, r.text
    assert_close_to_peak(decode(r.content)[0], restored)
    r = http.post("/v1/enhance", params={"level": "model"}, content=data, headers={"Content-Type": "audio/wav"})
    assert_close_to_peak(decode(r.content)[0], model)


def test_rest_bad_level(http):
    r = http.post("/v1/enhance", params={"level": "loud"}, content=wav_bytes(), headers={"Content-Type": "audio/wav"})
    assert_error(r, 422, "invalid_parameter", "level")
    r = http.post("/v1/enhance", files={"file": ("x.wav", wav_bytes(), "audio/wav")}, data={"level": "loud"})
    assert_error(r, 422, "invalid_parameter", "level must be model or input")


def test_websocket_level_start_field(live, enhancer_rt):
    rng = np.random.default_rng(22)
    x = signal(16000, 1, seconds=1.5, seed=22)[:, None]
    for level in ("input", "model", None):
        start = {} if level is None else {"level": level}
        y, texts, code = stream_through(live.ws_url, x, 16000, "f32le", random_chunks(len(x), rng), start)
        assert code == 1000 and y.shape == x.shape
        assert texts[0]["type"] == "ready" and texts[0]["level"] == (level or "model")
        assert_close_to_peak(y[:, 0], enhancer_rt.enhance(x[:, 0], 16000, level=level or "model"))
    expect_close(live.ws_url, [], 1007, "invalid_parameter", 'level must be "model" or "input"',
                 start={"level": "loud"})
