"""Errors raised for bad input, each specific enough to act on.

The service answers with the same messages: it maps `EmptyAudioError` to its `empty_input` kind,
`UnsupportedAudioError` to `unsupported_media`, `OutputFormatError` to `invalid_parameter` and any
other `AudioError` to `invalid_audio`."""


class EnhancerError(Exception):
    """Base class of every error this package raises on purpose."""


class AudioError(EnhancerError, ValueError):
    """The audio given cannot be processed (empty, wrong rank, NaN/Inf, absurd rate...)."""


class AudioDecodeError(AudioError):
    """The bytes or file given are not audio that libsndfile can read (malformed, truncated...)."""


class UnsupportedAudioError(AudioDecodeError):
    """The bytes or file given are not in any format libsndfile recognises."""


class EmptyAudioError(AudioError):
    """The file or body holds no samples."""


class OutputFormatError(EnhancerError, ValueError):
    """The output format asked for (an extension, `--format`, REST's `format`) cannot be written."""


class DeviceError(EnhancerError, RuntimeError):
    """The device asked for is not available here (e.g. `cuda` without a CUDA onnxruntime)."""


class CheckpointError(EnhancerError, ValueError):
    """A checkpoint or model file is missing, corrupt or does not match its config."""
