"""POST /v1/enhance: one audio file in, the enhanced file out (same rate, channels and length).

The upload is spooled to a temporary file (memory up to a threshold, then disk), decoded block by
block, streamed through the batched scheduler and encoded into another spooled file, so memory
stays bounded whatever the file's length.
"""
from __future__ import annotations

import asyncio
import tempfile
import time
from typing import Literal

import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from enhancer.audio_io import OUTPUT_FORMATS as FORMATS
from enhancer.audio_io import AudioReader, AudioWriter, output_format
from server.api.aio import timeout as _timeout
from server.api.auth import require_api_key
from server.api.keys import upload_too_long
from server.errors import ErrorKind, ServiceError
from server.messages import Source

SPOOL_BYTES = 8 * 1024 * 1024  # in memory up to this size, then a temporary file
ACCEPTED_TYPES = ("audio/", "application/octet-stream", "multipart/form-data")

router = APIRouter()


class ErrorDetail(BaseModel):
    kind: str
    message: str
    capacity: int | None = None  # over_capacity: live streams this server admits
    active_streams: int | None = None
    retry_after_s: float | None = None  # also the Retry-After header


class ErrorBody(BaseModel):
    error: ErrorDetail


def _error(description: str) -> dict:
    return {"model": ErrorBody, "description": description}


BAND_HELP = ("Above 16 kHz: `full` (default) adds the band above 8 kHz back, cleaned by per-band gains that follow "
             "its noise and the model's speech activity; "
             "`speech` returns the model's band only (nothing above 8 kHz)")
LEVEL_HELP = ("`model` (default): the model's output level; `input`: the voice given back at the input's speech "
              "level (the model returns it a few dB quieter)")
AUDIO_SCHEMA = {"type": "string", "format": "binary"}
REQUEST_BODY = {
    "required": True,
    "description": "The audio file: either the raw body with an audio Content-Type, or a multipart form "
                   "whose `file` field holds it (form fields `atten_lim_db`, `band`, `level` and `format` are accepted too).",
    "content": {
        **{t: {"schema": AUDIO_SCHEMA} for t in ("audio/wav", "audio/flac", "audio/ogg", "audio/mpeg",
                                                  "application/octet-stream")},
        "multipart/form-data": {"schema": {
            "type": "object", "required": ["file"],
            "properties": {
                "file": AUDIO_SCHEMA,
                "atten_lim_db": {"type": "number", "minimum": 0, "description": "Attenuation limit in dB"},
                "format": {"type": "string", "enum": list(FORMATS), "description": "Output container"},
                "band": {"type": "string", "enum": ["full", "speech"], "description": BAND_HELP},
                "level": {"type": "string", "enum": ["model", "input"], "description": LEVEL_HELP},
            }}},
    },
}
RESPONSES = {
    200: {"description": "The enhanced file, same sample rate, channel count and length as the input.",
          "content": {t: {"schema": AUDIO_SCHEMA} for t in ("audio/wav", "audio/flac", "audio/ogg", "audio/mpeg")},
          "headers": {"X-Sample-Rate": {"schema": {"type": "integer"}},
                      "X-Channels": {"schema": {"type": "integer"}},
                      "X-Frames": {"schema": {"type": "integer"}, "description": "Samples per channel"}}},
    400: _error("Empty body or malformed request"),
    401: _error("API key missing"),
    403: _error("API key wrong"),
    413: _error("Upload over the byte limit, or audio over the duration limit (the server's, or the API key's "
                "max_upload_s)"),
    415: _error("Not an audio file that can be decoded, or an unsupported Content-Type"),
    422: _error("Invalid audio (truncated, absurd sample rate, NaN/Inf, too many channels) or parameter"),
    429: _error("Over the API key's requests_per_minute; retry after Retry-After seconds"),
    503: _error("All enhancement slots are busy, or the live streams use all inference capacity; retry after "
                "Retry-After seconds"),
}


@router.post("/v1/enhance", summary="Enhance an audio file", dependencies=[Depends(require_api_key)],
             response_class=StreamingResponse, responses=RESPONSES, openapi_extra={"requestBody": REQUEST_BODY},
             tags=["enhance"])
async def enhance(
    request: Request,
    atten_lim_db: float | None = Query(None, ge=0, description="Attenuation limit in dB (dry/wet); "
                                       "omit for full suppression"),
    format: Literal["wav", "flac", "ogg", "mp3"] | None = Query(None, description="Output container; "
                                                               "default: the input's"),
    band: Literal["full", "speech"] = Query("full", description=BAND_HELP),
    level: Literal["model", "input"] = Query("model", description=LEVEL_HELP),
) -> StreamingResponse:
    """Decodes any format libsndfile reads (WAV, FLAC, OGG/Vorbis/Opus, MP3, AIFF ...), at any sample
    rate and channel count, and returns the enhanced audio in the same container (or `format`)."""
    settings = request.app.state.settings
    if request.app.state.draining:
        raise ServiceError(ErrorKind.SHUTTING_DOWN, "the server is shutting down; retry on another instance or later")
    t0 = time.perf_counter()
    upload, form = await _receive(request, settings.max_upload_bytes, settings.idle_timeout_s)
    try:
        if form is not None:
            atten_lim_db = _form_number(form, "atten_lim_db", atten_lim_db)
            format = form.get("format") or format
            band = form.get("band") or band
            if band not in ("full", "speech"):
                raise ServiceError(ErrorKind.INVALID_PARAMETER, f"band must be full or speech, got {band!r}")
            level = form.get("level") or level
            if level not in ("model", "input"):
                raise ServiceError(ErrorKind.INVALID_PARAMETER, f"level must be model or input, got {level!r}")
        out_file, writer, reader = await _enhance_file(request, upload, atten_lim_db, format, band, level)
    finally:
        upload.close()
    request.app.state.metrics.rest_seconds.observe(time.perf_counter() - t0)
    request.app.state.keys.audio_counter(request.scope, Source.REST)(reader.read_frames / reader.info.sample_rate)
    size = out_file.seek(0, 2)  # encoders may seek back to finish their header: measure from the end
    out_file.seek(0)
    info = reader.info
    headers = {"Content-Length": str(size), "X-Sample-Rate": str(info.sample_rate), "X-Channels": str(info.channels),
               "X-Frames": str(reader.read_frames),
               "Content-Disposition": f'attachment; filename="enhanced.{writer.extension}"'}
    return StreamingResponse(_iter_file(out_file), media_type=writer.media_type, headers=headers)


async def _enhance_file(request: Request, upload, atten_lim_db, format, band: str = "full", level: str = "model"):
    """Decode -> scheduler -> encode, block by block. Returns (spooled output, writer, reader)."""
    settings, scheduler = request.app.state.settings, request.app.state.scheduler
    limit_s, field = request.app.state.keys.upload_limit(request.scope, settings.max_duration_s)  # the key's may be lower
    reader = _open(upload, settings.max_channels, limit_s, field)
    max_frames = int(limit_s * reader.info.sample_rate)
    out_file = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)
    writer = None
    try:
        info = reader.info
        fmt, subtype = output_format(format, info)
        writer = AudioWriter(out_file, fmt, subtype, info.sample_rate, info.channels)
        job = scheduler.open(info.sample_rate, info.channels, atten_lim_db, False, Source.REST, band, level)
        try:
            block = max(1, int(settings.rest_chunk_s * info.sample_rate))
            while (x := await run_in_threadpool(reader.read, block)) is not None:
                if reader.read_frames > max_frames:
                    raise upload_too_long(limit_s, field)
                y = await job.process(x)
                await run_in_threadpool(writer.write, _finite(y))
            writer.write(_finite(await job.finish()))
        finally:
            job.close()
        writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        out_file.close()
        raise
    finally:
        reader.close()
    return out_file, writer, reader


def _open(upload, max_channels: int, max_duration_s: float, field: str | None = None) -> AudioReader:
    """The core's reader of the upload (its errors are mapped by the app's handler), within the
    service's limits on channels and duration (`field`: the API key's, when it is the lower)."""
    reader = AudioReader(upload)
    info = reader.info
    if not 1 <= info.channels <= max_channels:
        reader.close()
        raise ServiceError(ErrorKind.INVALID_AUDIO, f"the file has {info.channels} channels; at most {max_channels} "
                           "are supported")
    if info.duration_s > max_duration_s:
        reader.close()
        raise upload_too_long(max_duration_s, field, info.duration_s)
    return reader


def _finite(y):
    """Output guard: enhanced audio with NaN/Inf is never returned as a result."""
    if not np.isfinite(y).all():
        raise ServiceError(ErrorKind.INTERNAL, "the enhancement produced invalid samples; nothing was returned")
    return y


async def _receive(request: Request, limit: int, idle_s: float):
    """The upload as a spooled file, and the multipart form if the body is one. The byte limit is
    checked against Content-Length before anything is read and against the bytes while reading;
    a client that sends nothing for `idle_s` gets 408."""
    ctype = request.headers.get("content-type", "application/octet-stream").split(";")[0].strip().lower()
    if not ctype.startswith(ACCEPTED_TYPES):
        raise ServiceError(ErrorKind.UNSUPPORTED_MEDIA, f"Content-Type {ctype!r} is not audio; send the file with an audio/* "
                           "type (e.g. audio/wav) or as the 'file' field of a multipart/form-data body")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ServiceError(ErrorKind.TOO_LARGE, f"the upload is {int(length)} bytes; the limit is {limit} bytes")
    received = 0

    async def receive():
        """request.receive with the idle timeout and the byte limit."""
        nonlocal received
        try:
            async with _timeout(idle_s):
                message = await request.receive()
        except (asyncio.TimeoutError, TimeoutError):
            raise ServiceError(ErrorKind.IDLE_TIMEOUT, f"no upload data for {idle_s:g} s; closing the request") from None
        if message["type"] == "http.disconnect":
            raise ServiceError(ErrorKind.CLIENT_CLOSED, "the client closed the connection during the upload")
        received += len(message.get("body", b""))
        if received > limit:
            raise ServiceError(ErrorKind.TOO_LARGE, f"the upload is over the limit of {limit} bytes")
        return message

    body = Request(request.scope, receive)
    if ctype == "multipart/form-data":
        return await _receive_form(body)
    spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)
    try:
        async for chunk in body.stream():
            spool.write(chunk)
    except BaseException:
        spool.close()
        raise
    return spool, None


async def _receive_form(body: Request):
    try:
        form = await body.form(max_files=1, max_fields=8)
    except ServiceError:
        raise
    except Exception as e:  # starlette's multipart errors
        raise ServiceError(ErrorKind.BAD_REQUEST, f"malformed multipart body ({e})") from None
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        await form.close()
        if isinstance(upload, str):
            raise ServiceError(ErrorKind.BAD_REQUEST, "the multipart field 'file' must be a file part (its "
                               "Content-Disposition needs a filename), not a plain form value")
        raise ServiceError(ErrorKind.BAD_REQUEST, "the multipart body needs the audio file in a field named 'file'")
    return upload.file, form


def _form_number(form, name: str, default: float | None) -> float | None:
    value = form.get(name)
    if value in (None, ""):
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ServiceError(ErrorKind.INVALID_PARAMETER, f"{name} must be a number, got {value!r}") from None


async def _iter_file(f, chunk: int = 256 * 1024):
    try:
        while data := await run_in_threadpool(f.read, chunk):
            yield data
    finally:
        f.close()
