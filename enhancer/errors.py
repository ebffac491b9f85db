"""Errors raised for bad input, each specific enough to act on."""


class EnhancerError(Exception):
    """Base class of every error this package raises on purpose."""


class AudioError(EnhancerError, ValueError):
    """The audio given cannot be processed (empty, wrong rank, NaN/Inf, absurd rate...)."""


class AudioDecodeError(AudioError):
    """The bytes or file given are not audio that libsndfile can read."""


class CheckpointError(EnhancerError, ValueError):
    """A checkpoint or model file is missing, corrupt or does not match its config."""
