"""Audio files in and out: any format libsndfile reads, checked for completeness (a truncated file
is an error, not a shorter result), and the output formats the command line and the service's
REST `format` parameter both offer. The messages are the service's (its errors carry them).

`enhance_file` is the command line's file in, file out: processed in blocks through the streaming
core so that memory stays bounded on hour-long files.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import (
    AudioDecodeError,
    AudioError,
    EmptyAudioError,
    EnhancerError,
    OutputFormatError,
    UnsupportedAudioError,
)
from .signal import MAX_ABS_SAMPLE, check_rate, nonfinite_and_peak

BLOCK_SECONDS = 10.0

# Output containers by name (REST's `format`, the command line's `--format` and output extensions)
# -> libsndfile major format. Another container is written only where it is the input's own.
OUTPUT_FORMATS = {"wav": "WAV", "flac": "FLAC", "ogg": "OGG", "mp3": "MP3"}
MEDIA_TYPES = {"WAV": "audio/wav", "WAVEX": "audio/wav", "RF64": "audio/wav", "W64": "audio/x-w64",
               "FLAC": "audio/flac", "OGG": "audio/ogg", "MP3": "audio/mpeg", "AIFF": "audio/aiff",
               "AU": "audio/basic", "CAF": "audio/x-caf"}
EXTENSIONS = {"WAV": "wav", "WAVEX": "wav", "RF64": "wav", "W64": "w64", "FLAC": "flac", "OGG": "ogg",
              "MP3": "mp3", "AIFF": "aiff", "AU": "au", "CAF": "caf"}
MP3_SLACK = 2 * 1152  # MP3 frame counts from headers may be estimates: tolerate two MPEG frames
# Encoder limits libsndfile does not check itself: above 200 kHz its Vorbis encoder crashes the
# process when the file is closed (found by fuzzing the service).
VORBIS_MAX_RATE = 200_000
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


def audio_extensions() -> set[str]:
    import soundfile as sf

    exts = {f".{k.lower()}" for k in sf.available_formats()}
    return exts | {".oga", ".opus", ".mp3", ".aif", ".aiff"}


def find_audio(inputs: list[Path]) -> list[tuple[Path, Path]]:
    """(file, path relative to its input root) for each audio file under the inputs."""
    exts = audio_extensions()
    found = []
    for root in inputs:
        if root.is_dir():
            for p in sorted(root.rglob("*")):
                if p.is_file() and p.suffix.lower() in exts:
                    found.append((p, p.relative_to(root)))
        elif root.is_file():
            found.append((root, Path(root.name)))
        else:
            raise FileNotFoundError(f"no such file or folder: {root}")
    return found


def check_samples(x: np.ndarray, what: str = "the audio") -> None:
    """AudioError for NaN/Inf samples or values beyond +-MAX_ABS_SAMPLE."""
    if not x.size:
        return
    bad, peak = nonfinite_and_peak(x)
    if bad:
        raise AudioError(f"{what} contains NaN or Inf samples")
    if peak > MAX_ABS_SAMPLE:
        raise AudioError(f"{what} has sample values up to {peak:.3g}; float samples must lie "
                         f"within +-{MAX_ABS_SAMPLE:g} (full scale is +-1)")


def libsndfile_reason(e: Exception) -> str:
    """libsndfile's reason without the file: "Error opening 'x.wav': Format not recognised." ->
    "Format not recognised" (also for file objects, whose repr is in place of the name)."""
    msg = str(e)
    m = re.match(r"Error opening (?:<.*?>|'.*?'|\".*?\"): (.*)", msg, re.S)
    return (m.group(1) if m else msg).strip().rstrip(".") or type(e).__name__


# ---------------------------------------------------------------------------------- files in
@dataclass
class AudioInfo:
    sample_rate: int
    channels: int
    frames: int  # from the header (an estimate for some MP3s)
    format: str  # libsndfile major format, e.g. WAV
    subtype: str  # e.g. PCM_16
    endian: str = "FILE"

    @property
    def duration_s(self) -> float:
        return self.frames / self.sample_rate


class AudioReader:
    """Reads an audio file (a path or a seekable file object) block by block, checking that it is
    complete: a header that promises more than the file holds, or a file that ends early or breaks
    while reading, is an `AudioDecodeError` (not a shorter result). Samples must be finite."""

    def __init__(self, source):
        import soundfile as sf

        if hasattr(source, "seek"):
            source.seek(0, 2)
            size = source.tell()
            source.seek(0)
        else:
            source = str(source)
            size = Path(source).stat().st_size
        if size == 0:
            raise EmptyAudioError("the audio file is empty (0 bytes)")
        try:
            self.sf = sf.SoundFile(source)
        except sf.LibsndfileError as e:
            reason = libsndfile_reason(e)
            if "not recognised" in reason.lower():
                raise UnsupportedAudioError("the file is not an audio file libsndfile can read "
                                            "(WAV, FLAC, OGG/Vorbis/Opus, MP3, AIFF ...)") from None
            raise AudioDecodeError(f"the audio file is malformed or truncated ({reason})") from None
        except (RuntimeError, TypeError, ValueError) as e:
            raise AudioDecodeError(f"the audio file cannot be opened ({e})") from None
        f = self.sf
        self.info = AudioInfo(f.samplerate, f.channels, f.frames, f.format, f.subtype, f.endian)
        self.read_frames = 0
        try:
            check_rate(f.samplerate)
            check_header(f.format, f.frames, f.extra_info or "")
        except AudioError as e:
            self.close()
            if isinstance(e, (AudioDecodeError, EmptyAudioError)):
                raise
            raise AudioError(f"the file's {e}") from None

    def read(self, frames: int) -> np.ndarray | None:
        """The next block (n, channels) float32, or None at the (verified) end of the file."""
        import soundfile as sf

        try:
            x = self.sf.read(frames, dtype="float32", always_2d=True)
        except (sf.LibsndfileError, RuntimeError) as e:
            raise AudioDecodeError(f"the audio file is corrupt or truncated after "
                                   f"{self.read_frames} frames ({libsndfile_reason(e)})") from None
        if x.shape[0] == 0:
            check_complete(self.read_frames, self.info.frames, self.info.format)
            return None
        check_samples(x)
        self.read_frames += x.shape[0]
        return x

    def blocks(self, frames: int):
        """Yields float32 blocks (n, channels) up to the verified end of the file."""
        while (block := self.read(frames)) is not None:
            yield block

    def close(self) -> None:
        try:
            self.sf.close()
        except Exception:  # closing a broken decoder must not mask the real error
            pass

    def __enter__(self) -> AudioReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_header(fmt: str, frames: int, extra_info: str = "") -> None:
    """What libsndfile's header parse tells of a broken file: a truncated WAV (its data chunk
    promises more than the file holds), an OGG without an end-of-stream page, no samples."""
    if fmt in ("WAV", "WAVEX", "RF64", "W64") and re.search(r"data\s*:\s*\d+\s*\(should be", extra_info):
        raise AudioDecodeError("the WAV file is truncated: its header promises more audio data than the file holds")
    if fmt == "OGG" and "ended unexpectedly" in extra_info:
        raise AudioDecodeError("the OGG file is truncated (no end-of-stream page)")
    if frames <= 0:
        raise EmptyAudioError("the audio file contains no samples")


def check_complete(read_frames: int, header_frames: int, fmt: str) -> None:
    """At the end of a file: did it hold the frames its header promised (MP3: up to two frames less)?"""
    slack = MP3_SLACK if fmt == "MP3" else 0
    if read_frames + slack < header_frames:
        raise AudioDecodeError(f"the audio file is truncated: its header promises {header_frames} "
                               f"frames, it holds {read_frames}")
    if read_frames == 0:
        raise EmptyAudioError("the audio file contains no samples")


def check_file(src: Path) -> AudioInfo:
    """`src` read through once (the client checks a file before it sends it): the reader's errors,
    prefixed by the file's name as `enhancer denoise` says them. Its facts."""
    try:
        with AudioReader(src) as reader:
            while reader.read(1 << 16) is not None:
                pass
            return reader.info
    except AudioError as e:
        raise type(e)(f"{src}: {e}") from None


# ---------------------------------------------------------------------------------- files out
def output_format(requested: str | None, info: AudioInfo) -> tuple[str, str]:
    """(major format, subtype) of the output: `requested` (a name of OUTPUT_FORMATS) or the input's;
    the input's subtype where the container stays, else the container's default."""
    import soundfile as sf

    if requested is None or requested == "":
        fmt = info.format
    else:
        key = requested.lower().lstrip(".")
        if key not in OUTPUT_FORMATS:
            raise OutputFormatError(f"format must be one of {', '.join(OUTPUT_FORMATS)}, got {requested!r}")
        fmt = OUTPUT_FORMATS[key]
    subtype = info.subtype if fmt == info.format else sf.default_subtype(fmt)
    if not sf.check_format(fmt, subtype):
        subtype = sf.default_subtype(fmt)
    if fmt not in MEDIA_TYPES or not subtype or not sf.check_format(fmt, subtype):
        raise OutputFormatError(f"cannot write {fmt} files; ask for format=wav, flac, ogg or mp3")
    return fmt, subtype


def output_format_for_path(dst: Path, info: AudioInfo, src: Path | None = None,
                           requested: str | None = None) -> tuple[str, str]:
    """(major format, subtype) for writing `dst`, from its extension: one of OUTPUT_FORMATS, or the
    input's own extension (its container is kept, as REST does without `format`). `requested` (a
    `--format`) must agree with the extension. Anything else is an `OutputFormatError` that lists
    the extensions there are."""
    ext = dst.suffix.lower().lstrip(".")
    if requested:
        key = requested.lower().lstrip(".")
        if key in OUTPUT_FORMATS and ext != key:
            raise OutputFormatError(f"{dst.name}: the extension .{ext} does not match the format asked for "
                                    f"({key}); name the output .{key} or leave the format out")
        return output_format(requested, info)
    if ext in OUTPUT_FORMATS:
        return output_format(ext, info)
    if src is not None and ext and ext == src.suffix.lower().lstrip("."):
        return output_format(None, info)
    src_ext = src.suffix.lower().lstrip(".") if src is not None else ""
    own = f" (or the input's own .{src_ext})" if src_ext and src_ext not in OUTPUT_FORMATS else ""
    raise OutputFormatError(f"{dst.name}: cannot tell the output format from the extension "
                            f"{'.' + ext if ext else '(none)'}; use one of "
                            f"{', '.join('.' + k for k in OUTPUT_FORMATS)}{own}")


def check_encodable(fmt: str, subtype: str, sample_rate: int) -> None:
    """OutputFormatError unless libsndfile can safely write `subtype` at `sample_rate`."""
    if subtype == "VORBIS" and sample_rate > VORBIS_MAX_RATE:
        raise OutputFormatError(f"OGG/Vorbis cannot encode {sample_rate} Hz (at most "
                                f"{VORBIS_MAX_RATE} Hz); ask for format=wav or format=flac")
    if subtype == "OPUS" and sample_rate not in OPUS_RATES:
        raise OutputFormatError(f"OGG/Opus cannot encode {sample_rate} Hz (only "
                                f"{', '.join(map(str, OPUS_RATES))}); ask for format=wav or format=flac")


class AudioWriter:
    """Encodes enhanced blocks into a file (a path or a file object)."""

    def __init__(self, target, fmt: str, subtype: str, sample_rate: int, channels: int, endian: str = "FILE"):
        import soundfile as sf

        check_encodable(fmt, subtype, sample_rate)
        try:
            self.sf = sf.SoundFile(target if hasattr(target, "write") else str(target), "w", samplerate=sample_rate,
                                   channels=channels, format=fmt, subtype=subtype, endian=endian)
        except (sf.LibsndfileError, RuntimeError, ValueError) as e:
            raise OutputFormatError(f"cannot write {fmt}/{subtype} at {sample_rate} Hz with "
                                    f"{channels} channel(s) ({libsndfile_reason(e)}); choose another format") from None
        self.clip = not subtype.startswith(("FLOAT", "DOUBLE"))
        self.format, self.subtype = fmt, subtype

    def write(self, block: np.ndarray) -> None:
        if not block.shape[0]:
            return
        if self.subtype == "PCM_16":  # round to nearest, as the websocket's pcm_s16le does
            self.sf.write(np.clip(np.round(block * 32768.0), -32768, 32767).astype(np.int16))
        else:
            self.sf.write(np.clip(block, -1.0, 1.0) if self.clip else block)

    def close(self) -> None:
        self.sf.close()

    def abort(self) -> None:
        """Close after a failure (the output is thrown away)."""
        try:
            self.sf.close()
        except Exception:  # the real error is already on its way
            pass

    @property
    def media_type(self) -> str:
        return MEDIA_TYPES.get(self.format, "application/octet-stream")

    @property
    def extension(self) -> str:
        return EXTENSIONS.get(self.format, "bin")


# ---------------------------------------------------------------------------------- file to file
def enhance_file(enhancer, src: Path, dst: Path, atten_lim_db=None, progress: Callable[[int], None] | None = None,
                 format: str | None = None, band: str = "full", level: str = "model") -> dict:
    """Enhance `src` into `dst` (`band`, `level`: see `Enhancer.stream`): the same rate and channels, the container named by `dst`'s
    extension (or `format`, which must agree with it; see `output_format_for_path`). Broken input
    (unreadable, truncated, NaN/Inf ...) is an `AudioError` with the service's message, prefixed by
    the file's name; nothing is left at `dst` then. Returns file facts."""
    src, dst = Path(src), Path(dst)
    try:
        reader = AudioReader(src)
    except AudioError as e:
        raise type(e)(f"{src}: {e}") from None
    with reader:
        info = reader.info
        try:
            fmt, subtype = output_format_for_path(dst, info, src, format)
        except OutputFormatError as e:
            raise OutputFormatError(f"{e} (input {src})") from None
        stream = enhancer.stream(info.sample_rate, info.channels, atten_lim_db, band=band, level=level)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".part")
        writer = None
        n_out = 0
        try:
            writer = AudioWriter(tmp, fmt, subtype, info.sample_rate, info.channels,
                                 info.endian if fmt == info.format else "FILE")

            def write(y: np.ndarray) -> None:
                nonlocal n_out
                y = y.reshape(-1, info.channels)
                writer.write(y)
                n_out += y.shape[0]

            for block in reader.blocks(max(1, int(BLOCK_SECONDS * info.sample_rate))):
                write(stream.feed(block if info.channels > 1 else block[:, 0]))
                if progress:
                    progress(block.shape[0])
            write(stream.flush())
            writer.close()
        except BaseException as e:
            if writer is not None:
                writer.abort()
            tmp.unlink(missing_ok=True)
            if isinstance(e, EnhancerError) and not str(e).startswith(str(src)):
                raise type(e)(f"{src}: {e}") from None
            raise
        tmp.replace(dst)
        return {"path": str(dst), "sample_rate": info.sample_rate, "channels": info.channels, "frames": n_out,
                "format": fmt, "subtype": subtype}
