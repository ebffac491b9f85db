"""The service's typed protocol: where a job comes from (`Source`), the websocket start message
(`StartMessage`, validated by pydantic like the REST parameters), and the events an inference
worker reports about a live stream (`Late`, `OnTime`, `Gap`; `server.api.ws` turns them into JSON).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, ValidationError

from enhancer.config import SAMPLE_RATE
from server.api.pcm import ENCODINGS
from server.errors import ErrorKind, ServiceError, StrEnum


class Source(StrEnum):
    """Where a job comes from: a websocket stream (live) or a REST file."""

    STREAM = "stream"
    REST = "rest"


# ---------------------------------------------------------------------------------- stream events
@dataclass(frozen=True)
class Late:
    """A live stream fell behind the lateness budget (told once per episode)."""

    type: ClassVar[str] = "late"
    lateness_ms: float
    budget_ms: float
    max_lateness_ms: float


@dataclass(frozen=True)
class OnTime:
    """A live stream that was told it is late has caught up."""

    type: ClassVar[str] = "on_time"
    lateness_ms: float


@dataclass(frozen=True)
class Gap:
    """A live stream skipped its backlog: output samples [start_sample, start_sample + samples)
    (at the stream's rate) are not its enhanced input."""

    type: ClassVar[str] = "gap"
    start_sample: int
    samples: int
    skipped_ms: float
    lateness_ms: float


Event = Late | OnTime | Gap


def event_message(event: Event) -> dict:
    """The JSON message of an event: {"type": ..., then its fields in order}."""
    return {"type": event.type} | asdict(event)


# ---------------------------------------------------------------------------------- start message
START_HINT = ('the first text message must be the start message, a JSON object like '
              '{"sample_rate": 48000, "encoding": "pcm_s16le", "channels": 1}')


class StartMessage(BaseModel):
    """The optional first text message of a websocket stream; every field has a default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["start"] = "start"
    sample_rate: StrictInt = SAMPLE_RATE
    encoding: str = "pcm_s16le"
    channels: StrictInt = 1
    atten_lim_db: StrictInt | StrictFloat | None = None
    metadata: StrictBool = False
    band: Literal["full", "speech"] = "full"  # above 16 kHz: keep the band above 8 kHz, or not
    level: Literal["model", "input"] = "model"  # the model's output level, or the voice at the input's
    # at a restart: the stream's state in a "state" message before 1012, to continue exactly elsewhere
    resumable: StrictBool = False
    resume_bytes: StrictInt | None = None  # that state's size: it follows in binary messages, then the audio

    @classmethod
    def from_text(cls, text: str) -> StartMessage:
        """The start message in `text`, or the ServiceError that answers it."""
        try:
            msg = json.loads(text)
        except (ValueError, RecursionError):
            msg = None
        if not isinstance(msg, dict) or msg.get("type", "start") != "start":
            raise ServiceError(ErrorKind.BAD_REQUEST, START_HINT)
        try:
            start = cls.model_validate(msg)
        except ValidationError as e:
            raise _answer(msg, e) from None
        if start.encoding not in ENCODINGS:
            raise _unsupported_encoding(start.encoding)
        return start


FIELDS = [name for name in StartMessage.model_fields if name != "type"]


def _unsupported_encoding(value) -> ServiceError:
    return ServiceError(ErrorKind.UNSUPPORTED_MEDIA, f"encoding {value!r} is not supported; use one of "
                        f"{', '.join(ENCODINGS)}")


def _answer(msg: dict, e: ValidationError) -> ServiceError:
    """The client's answer to an invalid start message: the first problem in the order unknown
    fields, encoding, metadata, band, level, sample_rate, channels, atten_lim_db."""
    bad = {str(err["loc"][0]) for err in e.errors() if err.get("loc") and err["type"] != "extra_forbidden"}
    unknown = sorted(set(msg) - set(FIELDS) - {"type"})
    if unknown:
        return ServiceError(ErrorKind.INVALID_PARAMETER, f"unknown start field(s) {', '.join(unknown)}; "
                            f"known: {', '.join(FIELDS)}")
    if "encoding" in bad:
        return _unsupported_encoding(msg["encoding"])
    if "metadata" in bad:
        return ServiceError(ErrorKind.INVALID_PARAMETER, f"metadata must be true or false, got {msg['metadata']!r}")
    if "band" in bad:
        return ServiceError(ErrorKind.INVALID_PARAMETER, f"band must be \"full\" or \"speech\", got {msg['band']!r}")
    for name in ("resumable", "resume_bytes"):
        if name in bad:
            what = "true or false" if name == "resumable" else "an integer (the size of a \"state\" message's state) or null"
            return ServiceError(ErrorKind.INVALID_PARAMETER, f"{name} must be {what}, got {msg[name]!r}")
    if "level" in bad:
        return ServiceError(ErrorKind.INVALID_PARAMETER, f"level must be \"model\" or \"input\", got {msg['level']!r}")
    for name in ("sample_rate", "channels"):
        if name in bad:
            return ServiceError(ErrorKind.INVALID_PARAMETER, f"{name} must be an integer, got {msg[name]!r}")
    return ServiceError(ErrorKind.INVALID_PARAMETER, f"atten_lim_db must be a number or null, got "
                        f"{msg.get('atten_lim_db')!r}")
