"""Errors the service reports to clients: one kind each, with its HTTP status and websocket close code.

Responses carry `{"error": {"kind": ..., "message": ...}}` (REST) or
`{"type": "error", "kind": ..., "message": ...}` (websocket), never a stack trace.
"""
from __future__ import annotations

# kind: (HTTP status, websocket close code)
KINDS: dict[str, tuple[int, int]] = {
    "empty_input": (400, 1007),  # no bytes / no samples
    "bad_request": (400, 1007),  # malformed request or message
    "unauthorized": (401, 1008),  # API key missing
    "forbidden": (403, 1008),  # API key wrong
    "too_large": (413, 1009),  # upload or message over the byte limit
    "too_long": (413, 1008),  # audio over the duration limit
    "unsupported_media": (415, 1003),  # not audio we can read, text where audio belongs, unknown encoding
    "invalid_audio": (422, 1007),  # truncated, absurd rate, NaN/Inf, wrong channel count ...
    "invalid_parameter": (422, 1007),  # atten_lim_db, format, sample_rate, channels ...
    "not_found": (404, 1008),  # no such route or file
    "method_not_allowed": (405, 1008),
    "idle_timeout": (408, 1008),  # no message within the idle timeout
    "rate_limited": (429, 1008),  # websocket messages faster than the message-rate limit
    "over_capacity": (503, 1013),  # all streams / jobs / lanes busy
    "shutting_down": (503, 1012),  # the server is draining for a restart: reconnect
    "client_closed": (499, 1001),  # the client went away mid-request (nobody sees the answer)
    "internal": (500, 1011),  # a bug or a failed inference step
}


class ServiceError(Exception):
    """An error with a client-facing message; `kind` selects status and close code."""

    def __init__(self, kind: str, message: str, details: dict | None = None, retry_after_s: float | None = None):
        """`details`: extra JSON fields for the client (e.g. the capacity); `retry_after_s`: when to
        retry (REST: the Retry-After header; websocket: the `retry_after_s` field)."""
        if kind not in KINDS:
            raise ValueError(f"unknown error kind {kind!r}")
        super().__init__(message)
        self.kind, self.message = kind, message
        self.details = dict(details or {})
        self.retry_after_s = retry_after_s

    @property
    def status(self) -> int:
        return KINDS[self.kind][0]

    @property
    def close_code(self) -> int:
        return KINDS[self.kind][1]

    def _extra(self) -> dict:
        return self.details | ({} if self.retry_after_s is None else {"retry_after_s": self.retry_after_s})

    def rest_body(self) -> dict:
        return {"error": {"kind": self.kind, "message": self.message} | self._extra()}

    def ws_message(self) -> dict:
        return {"type": "error", "kind": self.kind, "message": self.message, "code": self.close_code} | self._extra()


def too_large(size: int, limit: int, at_least: bool = False) -> ServiceError:
    """The one answer to a websocket message over `max_message_bytes`, whoever sees it first: the
    handler (a whole message) or the protocol layer (a frame header, or fragments adding up)."""
    return ServiceError("too_large", f"a message of {'at least ' if at_least else ''}{size} bytes is over the limit of "
                                     f"{limit} bytes; send smaller chunks")
