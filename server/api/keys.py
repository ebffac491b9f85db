"""The API keys in force and what each name uses: authentication, the per-key limits (live streams
at once, REST requests per minute, seconds of audio per upload), per-key metrics (labelled by the
key's name, never by the key) and the reload of the key file (server/README.md, "API keys").

Usage is kept per name, not per key, and outlives a reload: a name whose key is rotated keeps its
streams and its request bucket. Everything here runs on the event loop.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from server.api.keyfile import ApiKey, KeyFileError, KeyRing, load_key_file
from server.errors import ErrorKind, ServiceError
from server.metrics import Metrics
from server.settings import Settings

log = logging.getLogger("tim_enhancer.server")

SCOPE_KEY = "tim.api_key"  # the ASGI scope's entry for the request's `Match` (set by the middleware)
STREAM_RETRY_S = 5  # as admission's: a stream holds its slot for minutes
UPLOAD_PATH = "/v1/enhance"
# refusals counted per key (tim_key_refused_total{reason}): a key's own limit (the `limit` detail
# of the error, the key file's field), or the server's capacity
REASONS = {"max_streams": "streams", "requests_per_minute": "requests", "max_upload_s": "upload_length"}


@dataclass(frozen=True)
class Match:
    """The key a request carries: its entry's name and the digest of the key itself."""

    name: str
    digest: bytes
    admin: bool


@dataclass
class Usage:
    """What one name holds: live streams, and its REST request bucket."""

    streams: int = 0
    tokens: float | None = None  # None: full
    refilled: float = 0.0


class Keys:
    """The key ring in force (None: no authentication) and the usage of each name."""

    def __init__(self, settings: Settings, metrics: Metrics):
        self.file: Path | None = settings.api_keys_file
        self.metrics = metrics
        if self.file is not None:
            self.ring: KeyRing | None = load_key_file(self.file)
        else:
            self.ring = KeyRing.single(settings.api_key) if settings.api_key else None
        self.usage: dict[str, Usage] = {}
        self._publish()

    @property
    def required(self) -> bool:
        return self.ring is not None

    # ------------------------------------------------------------------ authentication
    def authenticate(self, given: str | None, header: str = "X-API-Key") -> Match | None:
        """The request's key, or ServiceError unauthorized (none) / forbidden (not in force)."""
        if self.ring is None:
            return None
        if not given:
            raise ServiceError(ErrorKind.UNAUTHORIZED, f"an API key is required: send the {header} header")
        entry, d = self.ring.find(given)
        if entry is None:
            raise ServiceError(ErrorKind.FORBIDDEN, "the API key is not valid")
        return Match(entry.name, d, entry.admin)

    def limits(self, match: Match | None) -> ApiKey | None:
        return None if match is None or self.ring is None else self.ring.get(match.name)

    def _usage(self, name: str) -> Usage:
        u = self.usage.get(name)
        if u is None:
            u = self.usage[name] = Usage()
        return u

    # ------------------------------------------------------------------ limits
    def open_stream(self, scope) -> Match | None:
        """Take one of the key's live-stream slots (released by `close_stream`), or ServiceError:
        key_limit (1013, retry_after_s) at its limit; forbidden when it may open none."""
        match = scope.get(SCOPE_KEY)
        if match is None:
            return None
        limits, u = self.limits(match), self._usage(match.name)
        n = limits.max_streams if limits is not None else None
        if n == 0:
            raise ServiceError(ErrorKind.FORBIDDEN, "this API key may not open live streams (its max_streams is 0)",
                               {"limit": "max_streams"})
        if n is not None and u.streams >= n:
            log.info("refused a live stream of key %r (1013): it holds its limit of %d", match.name, n)
            raise ServiceError(ErrorKind.KEY_LIMIT, f"over this API key's limit of {n} live stream(s) at once "
                               f"(max_streams); retry in {STREAM_RETRY_S} s (key {match.name!r})",
                               {"limit": "max_streams", "max_streams": n}, STREAM_RETRY_S)
        u.streams += 1
        self.metrics.key_streams.labels(key_name=match.name).inc()
        self.metrics.key_active_streams.labels(key_name=match.name).set(u.streams)
        return match

    def close_stream(self, match: Match | None) -> None:
        if match is None:
            return
        u = self._usage(match.name)
        u.streams -= 1
        self.metrics.key_active_streams.labels(key_name=match.name).set(u.streams)
        if u.streams == 0 and (self.ring is None or self.ring.get(match.name) is None):
            self.usage.pop(match.name, None)  # a name no longer in force: nothing left to remember

    def take_request(self, match: Match | None) -> None:
        """Take a token from the key's bucket of POST /v1/enhance requests (a minute's worth, refilled
        at requests_per_minute), or ServiceError rate_limited (429 with Retry-After)."""
        limits = self.limits(match)
        rate = limits.requests_per_minute if limits is not None else None
        if rate is None:
            return
        if rate == 0:
            raise ServiceError(ErrorKind.FORBIDDEN, "this API key may not upload files (its requests_per_minute is 0)",
                               {"limit": "requests_per_minute"})
        u, now, burst = self._usage(match.name), time.monotonic(), max(float(rate), 1.0)
        u.tokens = burst if u.tokens is None else min(burst, u.tokens + (now - u.refilled) * rate / 60.0)
        u.refilled = now
        if u.tokens < 1.0:
            wait = (1.0 - u.tokens) * 60.0 / rate
            log.info("refused a request of key %r (429): over its %g requests per minute", match.name, rate)
            raise ServiceError(ErrorKind.RATE_LIMITED, f"over this API key's limit of {rate:g} requests per minute "
                               f"(requests_per_minute); retry in {math.ceil(wait)} s",
                               {"limit": "requests_per_minute"}, round(wait, 2))
        u.tokens -= 1.0

    def upload_limit(self, scope, max_duration_s: float) -> tuple[float, str | None]:
        """Seconds of audio one upload may hold, and the key file's field when the key's limit is
        the lower one (None: the server's `max_duration_s`)."""
        limits = self.limits(scope.get(SCOPE_KEY))
        if limits is not None and limits.max_upload_s is not None and limits.max_upload_s < max_duration_s:
            return float(limits.max_upload_s), "max_upload_s"
        return max_duration_s, None

    # ------------------------------------------------------------------ metrics
    def note_error(self, scope, err: ServiceError) -> None:
        """Count a refusal against the request's key: one of its own limits, or the capacity."""
        match = scope.get(SCOPE_KEY)
        if match is None:
            return
        reason = REASONS.get(err.details.get("limit")) or ("capacity" if err.kind == ErrorKind.OVER_CAPACITY else None)
        if reason is not None:
            self.metrics.key_refused.labels(key_name=match.name, reason=reason).inc()

    def count_request(self, scope, status: int) -> None:
        match = scope.get(SCOPE_KEY)
        if match is not None:
            self.metrics.key_requests.labels(key_name=match.name, status=str(status)).inc()

    def audio_counter(self, scope, source: str):
        """inc(seconds) of the audio the request's key sends (`source`: stream or rest)."""
        match = scope.get(SCOPE_KEY)
        if match is None:
            return _no_count
        return self.metrics.key_audio.labels(key_name=match.name, source=source).inc

    def _publish(self) -> None:
        m = self.metrics
        names = self.ring.names if self.ring is not None else []
        m.api_keys.set(len(names))
        for name in names:  # every name's series from the start, at zero
            m.key_active_streams.labels(key_name=name).set(self.usage.get(name, Usage()).streams)
            m.key_streams.labels(key_name=name)
            for source in ("stream", "rest"):
                m.key_audio.labels(key_name=name, source=source)
            for reason in (*REASONS.values(), "capacity"):
                m.key_refused.labels(key_name=name, reason=reason)

    # ------------------------------------------------------------------ reload
    def reload(self) -> tuple[KeyRing, KeyRing]:
        """Read the key file again: (old ring, new ring), the new one in force; or KeyFileError, the
        old one staying in force."""
        if self.file is None:
            raise KeyFileError("no key file to reload: the server was started without --api-keys")
        try:
            ring = load_key_file(self.file)
        except KeyFileError:
            self.metrics.key_reloads.labels(result="error").inc()
            raise
        old, self.ring = self.ring, ring
        self.metrics.key_reloads.labels(result="ok").inc()
        for name in [n for n, u in self.usage.items() if u.streams == 0 and ring.get(n) is None]:
            del self.usage[name]
        self._publish()
        return old, ring


def _no_count(_seconds: float) -> None:
    pass


def upload_too_long(limit_s: float, field: str | None, duration_s: float | None = None) -> ServiceError:
    """413 too_long for an upload over `limit_s`: the server's limit, or the key's (`field`)."""
    whose = "this API key's limit (max_upload_s)" if field else "the limit"
    what = f"the audio is {duration_s:.1f} s long" if duration_s is not None else "the audio is longer than the limit"
    return ServiceError(ErrorKind.TOO_LONG, f"{what}; {whose} is {limit_s:g} s per upload",
                        {"limit": field} if field else None)
