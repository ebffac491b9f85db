"""Audio in and out of the service: uploaded files (libsndfile via soundfile) and raw PCM frames.

Every failure becomes a `ServiceError` whose message says what is wrong with the input.
"""
from __future__ import annotations

import re

import numpy as np
import soundfile as sf

from enhancer import audio_io as core
from enhancer.audio_io import MP3_SLACK, OUTPUT_FORMATS, AudioInfo, libsndfile_reason
from enhancer.errors import AudioError, OutputFormatError
from enhancer.signal import check_rate
from server.errors import ErrorKind, ServiceError

# output containers, media types and encoder limits: the core's (the command line writes the same files)
FORMATS = OUTPUT_FORMATS
ENCODINGS = {"pcm_s16le": np.dtype("<i2"), "f32le": np.dtype("<f4")}


def check_samples(x: np.ndarray, what: str = "the audio") -> None:
    """The core's sample check (NaN/Inf, values beyond +-MAX_ABS_SAMPLE) as ServiceError (invalid_audio)."""
    try:
        core.check_samples(x, what)
    except AudioError as e:
        raise ServiceError(ErrorKind.INVALID_AUDIO, str(e)) from None


# ---------------------------------------------------------------------------------- files in
class AudioReader:
    """Reads an uploaded file block by block, checking that it is complete."""

    def __init__(self, fileobj, max_channels: int, max_duration_s: float):
        fileobj.seek(0, 2)
        size = fileobj.tell()
        fileobj.seek(0)
        if size == 0:
            raise ServiceError(ErrorKind.EMPTY_INPUT, "the request body is empty; send an audio file")
        try:
            self.sf = sf.SoundFile(fileobj)
        except sf.LibsndfileError as e:
            reason = libsndfile_reason(e)
            if "not recognised" in reason.lower():
                raise ServiceError(ErrorKind.UNSUPPORTED_MEDIA, "the body is not an audio file libsndfile can read "
                                   "(WAV, FLAC, OGG/Vorbis/Opus, MP3, AIFF ...)") from None
            raise ServiceError(ErrorKind.INVALID_AUDIO, f"the audio file is malformed or truncated ({reason})") from None
        except (RuntimeError, TypeError, ValueError) as e:
            raise ServiceError(ErrorKind.INVALID_AUDIO, f"the audio file cannot be opened ({e})") from None
        f = self.sf
        self.info = AudioInfo(f.samplerate, f.channels, f.frames, f.format, f.subtype, f.endian)
        self.read_frames = 0
        try:
            check_rate(f.samplerate)
        except AudioError as e:
            self.close()
            raise ServiceError(ErrorKind.INVALID_AUDIO, f"the file's {e}") from None
        if not 1 <= f.channels <= max_channels:
            self.close()
            raise ServiceError(ErrorKind.INVALID_AUDIO, f"the file has {f.channels} channels; at most {max_channels} are supported")
        self._check_header(max_duration_s)
        self.max_frames = int(max_duration_s * f.samplerate)

    def _check_header(self, max_duration_s: float) -> None:
        f, info = self.sf, self.info
        extra = f.extra_info or ""
        if info.format in ("WAV", "WAVEX", "RF64", "W64") and re.search(r"data\s*:\s*\d+\s*\(should be", extra):
            self.close()
            raise ServiceError(ErrorKind.INVALID_AUDIO, "the WAV file is truncated: its header promises more audio data "
                               "than the file holds")
        if info.format == "OGG" and "ended unexpectedly" in extra:
            self.close()
            raise ServiceError(ErrorKind.INVALID_AUDIO, "the OGG file is truncated (no end-of-stream page)")
        if info.frames <= 0:
            self.close()
            raise ServiceError(ErrorKind.EMPTY_INPUT, "the audio file contains no samples")
        if info.duration_s > max_duration_s:
            self.close()
            raise ServiceError(ErrorKind.TOO_LONG, f"the audio is {info.duration_s:.1f} s long; the limit is {max_duration_s:g} s")

    def blocks(self, frames: int):
        """Yields float32 blocks (n, channels); raises ServiceError if the file ends early or breaks."""
        while True:
            block = self.read(frames)
            if block is None:
                return
            yield block

    def read(self, frames: int) -> np.ndarray | None:
        """The next block (n, channels) float32, or None at the (verified) end of the file."""
        try:
            x = self.sf.read(frames, dtype="float32", always_2d=True)
        except (sf.LibsndfileError, RuntimeError) as e:
            raise ServiceError(ErrorKind.INVALID_AUDIO, f"the audio file is corrupt or truncated after "
                               f"{self.read_frames} frames ({libsndfile_reason(e)})") from None
        if x.shape[0] == 0:
            self._check_complete()
            return None
        check_samples(x)
        self.read_frames += x.shape[0]
        if self.read_frames > self.max_frames:
            raise ServiceError(ErrorKind.TOO_LONG, f"the audio is longer than the limit of {self.max_frames / self.info.sample_rate:g} s")
        return x

    def _check_complete(self) -> None:
        slack = MP3_SLACK if self.info.format == "MP3" else 0
        if self.read_frames + slack < self.info.frames:
            raise ServiceError(ErrorKind.INVALID_AUDIO, f"the audio file is truncated: its header promises {self.info.frames} "
                               f"frames, it holds {self.read_frames}")
        if self.read_frames == 0:
            raise ServiceError(ErrorKind.EMPTY_INPUT, "the audio file contains no samples")

    def close(self) -> None:
        try:
            self.sf.close()
        except Exception:  # closing a broken decoder must not mask the real error
            pass


# ---------------------------------------------------------------------------------- files out
def output_format(requested: str | None, info: AudioInfo) -> tuple[str, str]:
    """(major format, subtype) for the response: `requested` (wav, flac, ogg, mp3) or the input's."""
    try:
        return core.output_format(requested, info)
    except OutputFormatError as e:
        raise ServiceError(ErrorKind.INVALID_PARAMETER, str(e)) from None


def check_encodable(fmt: str, subtype: str, sample_rate: int) -> None:
    """ServiceError unless libsndfile can safely write `subtype` at `sample_rate`."""
    try:
        core.check_encodable(fmt, subtype, sample_rate)
    except OutputFormatError as e:
        raise ServiceError(ErrorKind.INVALID_PARAMETER, str(e)) from None


class AudioWriter(core.AudioWriter):
    """The core's encoder into a file object; its format errors are the service's invalid_parameter."""

    def __init__(self, fileobj, fmt: str, subtype: str, sample_rate: int, channels: int):
        try:
            super().__init__(fileobj, fmt, subtype, sample_rate, channels)
        except OutputFormatError as e:
            raise ServiceError(ErrorKind.INVALID_PARAMETER, str(e)) from None


# ---------------------------------------------------------------------------------- raw PCM
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
    check_samples(x, "the audio")
    return x


def encode_pcm(x: np.ndarray, encoding: str) -> bytes:
    """(n, channels) float32 -> interleaved little-endian PCM bytes."""
    if encoding == "pcm_s16le":
        return np.clip(np.round(x * 32768.0), -32768, 32767).astype("<i2").tobytes()
    return np.ascontiguousarray(x, dtype="<f4").tobytes()
