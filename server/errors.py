"""Errors the service reports to clients: one kind each, with its HTTP status and websocket close code.

Responses carry `{"error": {"kind": ..., "message": ...}}` (REST) or
`{"type": "error", "kind": ..., "message": ...}` (websocket), never a stack trace. The core's
errors (`enhancer.errors`) become service errors in one place, `from_core`: the app's exception
handler for REST, the websocket handler and the workers for streams.
"""
from __future__ import annotations

import math

from enhancer.errors import EmptyAudioError, EnhancerError, OutputFormatError, StateError, UnsupportedAudioError

try:
    from enum import StrEnum
except ImportError:  # pragma: no cover - Python 3.10
    from enum import Enum

    class StrEnum(str, Enum):
        """enum.StrEnum of Python 3.11: members are their values as strings."""

        def __str__(self) -> str:
            return self.value

        def __format__(self, spec: str) -> str:
            return format(self.value, spec)


class ErrorKind(StrEnum):
    """What went wrong, as clients see it (`kind` of the JSON error)."""

    EMPTY_INPUT = "empty_input"  # no bytes / no samples
    BAD_REQUEST = "bad_request"  # malformed request or message
    UNAUTHORIZED = "unauthorized"  # API key missing
    FORBIDDEN = "forbidden"  # API key wrong
    TOO_LARGE = "too_large"  # upload or message over the byte limit
    TOO_LONG = "too_long"  # audio over the duration limit
    UNSUPPORTED_MEDIA = "unsupported_media"  # not audio we can read, text where audio belongs, unknown encoding
    INVALID_AUDIO = "invalid_audio"  # truncated, absurd rate, NaN/Inf, wrong channel count ...
    INVALID_PARAMETER = "invalid_parameter"  # atten_lim_db, format, sample_rate, channels ...
    NOT_FOUND = "not_found"  # no such route or file
    METHOD_NOT_ALLOWED = "method_not_allowed"
    IDLE_TIMEOUT = "idle_timeout"  # no message within the idle timeout
    RATE_LIMITED = "rate_limited"  # websocket messages faster than the message-rate limit; REST requests over a key's rate
    KEY_LIMIT = "key_limit"  # an API key holds its limit of live streams (server.api.keys)
    OVER_CAPACITY = "over_capacity"  # all streams / jobs / lanes busy
    SHUTTING_DOWN = "shutting_down"  # the server is draining for a restart: reconnect
    INVALID_STATE = "invalid_state"  # a resumed stream's state is not readable, or not of this stream
    CLIENT_CLOSED = "client_closed"  # the client went away mid-request (nobody sees the answer)
    INVALID_KEY_FILE = "invalid_key_file"  # POST /v1/admin/reload: the key file is malformed (the old keys stay)
    INTERNAL = "internal"  # a bug or a failed inference step


# kind: (HTTP status, websocket close code)
KINDS: dict[ErrorKind, tuple[int, int]] = {
    ErrorKind.EMPTY_INPUT: (400, 1007),
    ErrorKind.BAD_REQUEST: (400, 1007),
    ErrorKind.UNAUTHORIZED: (401, 1008),
    ErrorKind.FORBIDDEN: (403, 1008),
    ErrorKind.TOO_LARGE: (413, 1009),
    ErrorKind.TOO_LONG: (413, 1008),
    ErrorKind.UNSUPPORTED_MEDIA: (415, 1003),
    ErrorKind.INVALID_AUDIO: (422, 1007),
    ErrorKind.INVALID_PARAMETER: (422, 1007),
    ErrorKind.NOT_FOUND: (404, 1008),
    ErrorKind.METHOD_NOT_ALLOWED: (405, 1008),
    ErrorKind.IDLE_TIMEOUT: (408, 1008),
    ErrorKind.RATE_LIMITED: (429, 1008),
    ErrorKind.KEY_LIMIT: (429, 1013),
    ErrorKind.OVER_CAPACITY: (503, 1013),
    ErrorKind.SHUTTING_DOWN: (503, 1012),
    ErrorKind.INVALID_STATE: (422, 1007),
    ErrorKind.CLIENT_CLOSED: (499, 1001),
    ErrorKind.INVALID_KEY_FILE: (422, 1011),
    ErrorKind.INTERNAL: (500, 1011),
}


class ServiceError(Exception):
    """An error with a client-facing message; `kind` selects status and close code."""

    def __init__(self, kind: ErrorKind | str, message: str, details: dict | None = None,
                 retry_after_s: float | None = None):
        """`details`: extra JSON fields for the client (e.g. the capacity); `retry_after_s`: when to
        retry (REST: the Retry-After header; websocket: the `retry_after_s` field)."""
        try:
            kind = ErrorKind(kind)
        except ValueError:
            raise ValueError(f"unknown error kind {kind!r}") from None
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.message = message
        self.details = dict(details or {})
        self.retry_after_s = retry_after_s

    @property
    def status(self) -> int:
        return KINDS[self.kind][0]

    @property
    def retry_after_header(self) -> str | None:
        """The REST Retry-After value (whole seconds, at least 1): the error's `retry_after_s`, else 1
        for over_capacity and shutting_down; None for errors not worth retrying as they are."""
        retry = self.retry_after_s
        if retry is None and self.kind in (ErrorKind.OVER_CAPACITY, ErrorKind.SHUTTING_DOWN):
            retry = 1
        return None if retry is None else str(max(1, math.ceil(retry)))

    @property
    def close_code(self) -> int:
        return KINDS[self.kind][1]

    def _extra(self) -> dict:
        return self.details | ({} if self.retry_after_s is None else {"retry_after_s": self.retry_after_s})

    def rest_body(self) -> dict:
        return {"error": {"kind": self.kind.value, "message": self.message} | self._extra()}

    def ws_message(self) -> dict:
        return {"type": "error", "kind": self.kind.value, "message": self.message,
                "code": self.close_code} | self._extra()


def from_core(e: EnhancerError, kind: ErrorKind = ErrorKind.INVALID_AUDIO) -> ServiceError:
    """The service's answer to an error of the core (`enhancer.errors`), with the core's message: the
    one place they are mapped. No samples: empty_input; not audio libsndfile recognises:
    unsupported_media; an output format that cannot be written: invalid_parameter; any other bad
    input: `kind` (invalid_audio, or invalid_parameter where the input is a job's parameters)."""
    if isinstance(e, EmptyAudioError):
        return ServiceError(ErrorKind.EMPTY_INPUT, str(e))
    if isinstance(e, UnsupportedAudioError):
        return ServiceError(ErrorKind.UNSUPPORTED_MEDIA, str(e))
    if isinstance(e, OutputFormatError):
        return ServiceError(ErrorKind.INVALID_PARAMETER, str(e))
    if isinstance(e, StateError):
        return ServiceError(ErrorKind.INVALID_STATE, str(e))
    if isinstance(e, ValueError):  # AudioError and the rest of the core's bad-input errors
        return ServiceError(kind, str(e))
    return ServiceError(ErrorKind.INTERNAL, "internal error")


def too_large(size: int, limit: int, at_least: bool = False) -> ServiceError:
    """The one answer to a websocket message over `max_message_bytes`, whoever sees it first: the
    handler (a whole message) or the protocol layer (a frame header, or fragments adding up)."""
    return ServiceError(ErrorKind.TOO_LARGE, f"a message of {'at least ' if at_least else ''}{size} bytes is over "
                        f"the limit of {limit} bytes; send smaller chunks")
