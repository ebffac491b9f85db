"""Raw PCM in websocket messages: interleaved little-endian samples <-> (n, channels) float32.

Uploaded files are read with the core's reader (`enhancer.audio_io`); a malformed message is a
`ServiceError` whose message says what is wrong with it.
"""
from __future__ import annotations

import numpy as np

from enhancer.audio_io import check_samples
from enhancer.errors import AudioError
from server.errors import ErrorKind, ServiceError, from_core

ENCODINGS = {"pcm_s16le": np.dtype("<i2"), "f32le": np.dtype("<f4")}


def frame_bytes(encoding: str, channels: int) -> int:
    return ENCODINGS[encoding].itemsize * channels


def decode_pcm(data: bytes, encoding: str, channels: int) -> np.ndarray:
    """Interleaved little-endian PCM -> (n, channels) float32 (int16 scaled to [-1, 1))."""
    size = frame_bytes(encoding, channels)
    if len(data) % size:
        raise ServiceError(ErrorKind.INVALID_AUDIO, f"a binary message of {len(data)} bytes is not a whole number of "
                           f"{encoding} frames ({size} bytes per frame for {channels} channel(s))")
    x = np.frombuffer(data, dtype=ENCODINGS[encoding]).reshape(-1, channels)
    if encoding == "pcm_s16le":
        return x.astype(np.float32) / 32768.0
    x = x.astype(np.float32)
    try:
        check_samples(x, "the audio")
    except AudioError as e:
        raise from_core(e) from None
    return x


def encode_pcm(x: np.ndarray, encoding: str) -> bytes:
    """(n, channels) float32 -> interleaved little-endian PCM bytes."""
    if encoding == "pcm_s16le":
        return np.clip(np.round(x * 32768.0), -32768, 32767).astype("<i2").tobytes()
    return np.ascontiguousarray(x, dtype="<f4").tobytes()
