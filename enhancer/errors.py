"""Errors raised for bad input, each specific enough to act on, and the client's (`ClientError`).

The service answers with the same messages: it maps `EmptyAudioError` to its `empty_input` kind,
`UnsupportedAudioError` to `unsupported_media`, `OutputFormatError` to `invalid_parameter` and any
other `AudioError` to `invalid_audio`."""
from __future__ import annotations


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


class StateError(EnhancerError, ValueError):
    """A stream state handed back (a resumed stream's) is not readable, or is not a state of this
    stream: another model, other stream parameters, or arrays that do not fit."""


class ClientError(EnhancerError):
    """What the service answered instead of enhanced audio, or why it could not be reached.

    `kind`: the service's error kind (`over_capacity`, `invalid_audio`, `unauthorized` ...; see
    server/README.md), or `unreachable` (no connection), `invalid_url`, `protocol` (an answer that
    is not the service's); `status`: the HTTP status or the websocket close code, when there is one;
    `retry_after_s`: the service's hint, when it gives one."""

    def __init__(self, kind: str, message: str, status: int | None = None, retry_after_s: float | None = None,
                 details: dict | None = None):
        super().__init__(message)
        self.kind, self.message, self.status = kind, message, status
        self.retry_after_s, self.details = retry_after_s, dict(details or {})

    def __str__(self) -> str:
        return self.message if self.kind in self.message else f"{self.message} ({self.kind})"

    @classmethod
    def from_body(cls, status: int | None, body, retry_after_s: float | None = None) -> ClientError:
        """The error of a REST body `{"error": {...}}` or a websocket message `{"type": "error", ...}`."""
        e = body.get("error", body) if isinstance(body, dict) else None
        if not isinstance(e, dict) or "kind" not in e:
            return cls("protocol", f"the service answered {status} without its error message", status)
        extra = {k: v for k, v in e.items() if k not in ("kind", "message", "type", "code", "retry_after_s")}
        return cls(str(e["kind"]), str(e.get("message", "")), status, e.get("retry_after_s", retry_after_s), extra)
