"""POST /v1/enhance against the real server: round trips and every kind of bad upload."""
from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from tests.conftest import broken_audio, core_message, speechlike
from tests.tolerance import assert_close_to_peak, assert_differs

LSB = 1 / 32768


def encode(x: np.ndarray, sr: int, fmt: str, subtype: str | None = None) -> bytes:
    b = io.BytesIO()
    sf.write(b, x, sr, format=fmt, subtype=subtype)
    return b.getvalue()


def decode(data: bytes) -> tuple[np.ndarray, int, sf._SoundFileInfo]:
    x, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return x, sr, sf.info(io.BytesIO(data))


def signal(sr: int, channels: int, seconds: float = 0.7, seed: int = 0) -> np.ndarray:
    x = speechlike(int(seconds * sr), sr, seed=seed, channels=channels if channels > 1 else 0)
    return x


def expected(enhancer_rt, data: bytes, **kw) -> tuple[np.ndarray, int]:
    """Enhancer.enhance on the upload decoded the way a client decodes it (soundfile, float32)."""
    x, sr, _ = decode(data)
    return enhancer_rt.enhance(x if x.shape[1] > 1 else x[:, 0], sr, **kw).reshape(x.shape), sr


def assert_error(r, status: int, kind: str, words: str = "") -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"]["kind"] == kind, body
    assert words.lower() in body["error"]["message"].lower(), body
    assert "Traceback" not in r.text


CONTAINERS = {"wav": ("WAV", "PCM_16", "audio/wav"), "flac": ("FLAC", "PCM_16", "audio/flac"),
              "ogg": ("OGG", "VORBIS", "audio/ogg")}


@pytest.mark.parametrize("channels", [1, 2])
@pytest.mark.parametrize("sr", [8000, 16000, 44100, 48000])
@pytest.mark.parametrize("container", ["wav", "flac", "ogg"])
def test_round_trip_equals_offline_enhance(http, enhancer_rt, container, sr, channels):
    fmt, subtype, ctype = CONTAINERS[container]
    data = encode(signal(sr, channels), sr, fmt, subtype)
    ref, _ = expected(enhancer_rt, data)
    # the same container back (lossy for ogg: compare its properties and closeness)
    r = http.post("/v1/enhance", content=data, headers={"Content-Type": ctype})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == ctype
    y, out_sr, info = decode(r.content)
    assert (out_sr, y.shape, info.format) == (sr, ref.shape, fmt)
    assert int(r.headers["X-Frames"]) == ref.shape[0]
    if container == "ogg":
        err = np.sum((y - ref) ** 2) / np.sum(ref ** 2)
        assert err < 0.1, f"vorbis output too far from the offline enhancement: relative error {err:.3f}"
        # exact comparison through a lossless container
        r = http.post("/v1/enhance", params={"format": "wav"}, content=data, headers={"Content-Type": ctype})
        assert r.status_code == 200, r.text
        y, out_sr, info = decode(r.content)
        assert (out_sr, y.shape, info.format, info.subtype) == (sr, ref.shape, "WAV", "PCM_16")
    # 16-bit output: equal up to the output's quantisation
    assert_close_to_peak(y, np.clip(ref, -1, 1), plus=LSB * 0.5)


def test_float_wav_is_returned_bit_exact_as_float(http, enhancer_rt):
    data = encode(signal(22050, 1, seconds=1.3, seed=3), 22050, "WAV", "FLOAT")
    ref, _ = expected(enhancer_rt, data)
    r = http.post("/v1/enhance", content=data, headers={"Content-Type": "audio/wav"})
    assert r.status_code == 200, r.text
    y, sr, info = decode(r.content)
    assert (sr, info.subtype) == (22050, "FLOAT")
    assert_close_to_peak(y, ref)


def test_multipart_with_form_fields(http, enhancer_rt):
    data = encode(signal(16000, 2, seed=5), 16000, "WAV", "PCM_16")
    ref, _ = expected(enhancer_rt, data, atten_lim_db=6.0)
    files = {"file": ("noisy.wav", data, "audio/wav")}
    r = http.post("/v1/enhance", files=files, data={"atten_lim_db": "6", "format": "flac"})
    assert r.status_code == 200, r.text
    y, sr, info = decode(r.content)
    assert (sr, info.format, y.shape) == (16000, "FLAC", ref.shape)
    assert_close_to_peak(y, np.clip(ref, -1, 1), plus=LSB * 0.5)
    # the limit made a difference (the output is not just the full-suppression one)
    full, _ = expected(enhancer_rt, data)
    assert_differs(full, ref)


def test_attenuation_limit_query(http, enhancer_rt):
    data = encode(signal(48000, 1, seed=7), 48000, "WAV", "FLOAT")
    ref, _ = expected(enhancer_rt, data, atten_lim_db=12.0)
    r = http.post("/v1/enhance", params={"atten_lim_db": 12}, content=data, headers={"Content-Type": "audio/wav"})
    assert r.status_code == 200, r.text
    y, _, _ = decode(r.content)
    assert_close_to_peak(y, ref)


def test_long_file_goes_through_in_blocks(http, live, enhancer_rt):
    """12 s at 16 kHz with 0.25 s blocks: 48 decode/enhance/encode blocks, same result."""
    data = encode(signal(16000, 1, seconds=12.0, seed=9), 16000, "FLAC", "PCM_16")
    ref, _ = expected(enhancer_rt, data)
    frames_before = live.metrics.frames.labels(source="rest")._value.get()
    r = http.post("/v1/enhance", content=data, headers={"Content-Type": "audio/flac"})
    assert r.status_code == 200, r.text
    y, _, _ = decode(r.content)
    assert_close_to_peak(y, np.clip(ref, -1, 1), plus=LSB * 0.5)
    hops = live.metrics.frames.labels(source="rest")._value.get() - frames_before
    assert hops >= 12.0 / 0.016


# ---------------------------------------------------------------------------------- bad input
def wav_bytes(sr=16000, seconds=0.5, subtype="PCM_16", channels=1) -> bytes:
    return encode(signal(sr, channels, seconds=seconds), sr, "WAV", subtype)


def test_empty_body(http):
    assert_error(http.post("/v1/enhance", content=b"", headers={"Content-Type": "audio/wav"}), 400, "empty_input", "empty")


def test_random_bytes(http):
    junk = np.random.default_rng(0).bytes(20000)
    assert_error(http.post("/v1/enhance", content=junk, headers={"Content-Type": "audio/wav"}), 415,
                 "unsupported_media", "not an audio file")


@pytest.mark.parametrize("container", ["wav", "flac", "ogg"])
def test_truncated_file(http, container):
    fmt, subtype, ctype = CONTAINERS[container]
    data = encode(signal(16000, 1, seconds=2.0), 16000, fmt, subtype)
    r = http.post("/v1/enhance", content=data[: len(data) // 2], headers={"Content-Type": ctype})
    assert_error(r, 422, "invalid_audio", "truncated")


def test_malformed_header_names_the_reason(http):
    """libsndfile's reason reaches the client without the server's file object in it."""
    data = wav_bytes()[:30]  # RIFF/WAVE and part of the fmt chunk, no data chunk
    r = http.post("/v1/enhance", content=data, headers={"Content-Type": "audio/wav"})
    assert_error(r, 422, "invalid_audio", "malformed or truncated (Error in WAV file")
    message = r.json()["error"]["message"]
    assert "<_io" not in message and "Error opening" not in message, message


def test_not_audio_content_type(http):
    r = http.post("/v1/enhance", content=b'{"audio": 1}', headers={"Content-Type": "application/json"})
    assert_error(r, 415, "unsupported_media", "content-type")


@pytest.mark.parametrize("rate", [400, 1_000_000])
def test_absurd_sample_rate(http, rate):
    x = signal(16000, 1, seconds=0.2)
    data = encode(x, rate, "WAV", "PCM_16")  # the header claims `rate`
    assert_error(http.post("/v1/enhance", content=data, headers={"Content-Type": "audio/wav"}), 422,
                 "invalid_audio", "sample rate")


def test_nan_samples(http):
    x = signal(16000, 1, seconds=0.5)
    x[1234] = np.nan
    data = encode(x, 16000, "WAV", "FLOAT")
    assert_error(http.post("/v1/enhance", content=data, headers={"Content-Type": "audio/wav"}), 422,
                 "invalid_audio", "nan")


def test_oversize_upload(http, live):
    limit = live.settings.max_upload_bytes
    data = b"RIFF" + bytes(limit)
    assert_error(http.post("/v1/enhance", content=data, headers={"Content-Type": "audio/wav"}), 413, "too_large", "limit")

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(limit // 65536 + 2):
            yield bytes(65536)

    assert_error(http.post("/v1/enhance", content=chunks(), headers={"Content-Type": "audio/wav"}), 413, "too_large")
    r = http.post("/v1/enhance", files={"file": ("big.wav", data, "audio/wav")})
    assert_error(r, 413, "too_large")


def test_too_long_audio(http, live):
    seconds = live.settings.max_duration_s + 1
    data = encode(np.zeros(int(seconds * 8000), np.int16), 8000, "WAV", "PCM_16")  # small: 8 kHz silence
    assert_error(http.post("/v1/enhance", content=data, headers={"Content-Type": "audio/wav"}), 413, "too_long")


def test_bad_parameters(http):
    data = wav_bytes()
    h = {"Content-Type": "audio/wav"}
    assert_error(http.post("/v1/enhance", params={"atten_lim_db": -3}, content=data, headers=h), 422,
                 "invalid_parameter", "atten_lim_db")
    assert_error(http.post("/v1/enhance", params={"atten_lim_db": "loud"}, content=data, headers=h), 422,
                 "invalid_parameter", "atten_lim_db")
    assert_error(http.post("/v1/enhance", params={"format": "aac"}, content=data, headers=h), 422,
                 "invalid_parameter", "format")
    assert_error(http.post("/v1/enhance", files={"file": ("a.wav", data, "audio/wav")}, data={"format": "aac"}), 422,
                 "invalid_parameter", "format")
    assert_error(http.post("/v1/enhance", files={"upload": ("a.wav", data, "audio/wav")}), 400, "bad_request", "'file'")


def test_too_many_channels(http, live):
    n = live.settings.max_channels + 1
    data = encode(np.zeros((1600, n), np.float32), 16000, "WAV", "FLOAT")
    assert_error(http.post("/v1/enhance", content=data, headers={"Content-Type": "audio/wav"}), 422,
                 "invalid_audio", "channels")


def test_server_keeps_serving_after_bad_input(http, live, enhancer_rt):
    """After every error above (the module runs them first), a good request still works, nothing leaks,
    and the errors were counted by kind."""
    data = wav_bytes(seconds=0.3)
    r = http.post("/v1/enhance", content=data, headers={"Content-Type": "audio/wav"})
    assert r.status_code == 200, r.text
    live.wait_idle()
    text = http.get("/metrics").text
    for kind in ("empty_input", "unsupported_media", "invalid_audio", "too_large", "too_long", "invalid_parameter"):
        line = next(ln for ln in text.splitlines() if ln.startswith(f'tim_errors_total{{kind="{kind}"}}'))
        assert float(line.split()[-1]) >= 1, line
    assert 'tim_rest_requests_total{status="200"}' in text


@pytest.mark.parametrize("sr,channels", [(44100, 2), (48000, 1)])
def test_band_query_and_form_field(http, enhancer_rt, sr, channels):
    """Full band is the default above 16 kHz; band=speech (query or form field) gives the model's band."""
    # the test model's upper-band gain is mostly closed; the attenuation limit floors it (12 dB)
    data = encode(signal(sr, channels, seed=11), sr, "WAV", "FLOAT")
    full, _ = expected(enhancer_rt, data, atten_lim_db=12)
    speech, _ = expected(enhancer_rt, data, atten_lim_db=12, band="speech")
    assert_differs(full, speech)
    q = {"atten_lim_db": 12}
    r = http.post("/v1/enhance", params=q, content=data, headers={"Content-Type": "audio/wav"})
    assert r.status_code == 200, r.text
    assert_close_to_peak(decode(r.content)[0], full)
    r = http.post("/v1/enhance", params=q | {"band": "speech"}, content=data, headers={"Content-Type": "audio/wav"})
    assert r.status_code == 200, r.text
    assert_close_to_peak(decode(r.content)[0], speech)
    r = http.post("/v1/enhance", files={"file": ("x.wav", data, "audio/wav")}, data={"band": "speech", "atten_lim_db": "12"})
    assert r.status_code == 200, r.text
    y = decode(r.content)[0]
    assert y.shape == speech.shape
    assert_close_to_peak(y, speech)


def test_bad_band(http):
    r = http.post("/v1/enhance", params={"band": "wide"}, content=wav_bytes(48000), headers={"Content-Type": "audio/wav"})
    assert r.status_code == 422, r.text
    r = http.post("/v1/enhance", files={"file": ("x.wav", wav_bytes(48000), "audio/wav")}, data={"band": "wide"})
    assert_error(r, 422, "invalid_parameter", "band")


def test_broken_files_get_the_readers_own_message(http):
    """The service reads uploads with the core's reader and maps its errors in one place: each
    broken file's answer carries the reader's message (what `enhancer denoise` prints), with the
    kind of its error."""
    kinds = {"truncated.wav": (422, "invalid_audio"), "junk.wav": (415, "unsupported_media"),
             "nan.wav": (422, "invalid_audio"), "header.wav": (422, "invalid_audio"), "empty.wav": (400, "empty_input")}
    for name, data in broken_audio().items():
        r = http.post("/v1/enhance", content=data, headers={"Content-Type": "audio/wav"})
        assert_error(r, *kinds[name])
        assert r.json()["error"]["message"] == core_message(data), name

