"""A client of the tim-enhancer service, installed with the package (numpy, soundfile, websockets;
no onnxruntime, no torch): `Client(url, api_key=None)`.

    from enhancer.client import Client, ClientError

    client = Client("http://127.0.0.1:8000")
    client.enhance_file("noisy.wav", "clean.wav", level="input")    # REST, POST /v1/enhance

    async with client.stream(sample_rate=16000, channels=1) as s:   # websocket, /v1/stream
        await s.send(chunk)                                          # PCM of any size, as it comes
        ...
        await s.end()
        async for y in s:                                            # enhanced PCM, sample-aligned
            ...

The stream survives the service's restarts and a full service: on close 1013 (over capacity) it
waits the `retry_after_s` the error gives and connects again; on 1012 (a restart: the service sends
the enhanced tail of all it read first), 1001 or a lost connection it reconnects with a backoff and
resends the input from the first sample whose output it does not have, `resume_overlap_s` earlier,
dropping the output of that overlap, so the output is neither cut nor repeated and the model has
warmed up by then (`enhancer.client_stream`). Whatever the service refuses is a `ClientError` with
its `kind` and message; bad local input (a truncated or unreadable file, NaN samples ...) raises
the command line's own errors (`enhancer.audio_io.AudioReader`). The command line's `enhancer
stream IN -o OUT --url URL` (`enhancer.stream_command`) streams a file through it.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from pathlib import Path

import numpy as np

from .audio_io import MEDIA_TYPES, OUTPUT_FORMATS, AudioInfo, check_file, output_format_for_path
from .client_stream import Stream, stream_file
from .errors import ClientError

__all__ = ["DEFAULT_URL", "Client", "ClientError", "Stream", "enhance_stream", "urls"]

DEFAULT_URL = "http://127.0.0.1:8000"
REST_PATH, STREAM_PATH = "/v1/enhance", "/v1/stream"
OPTIONS = ("atten_lim_db", "band", "level")  # the enhancement options of REST and of the start message
RETRIED = ("over_capacity", "shutting_down")  # REST answers (503) that are worth another try
FACTS = {"sample_rate": "X-Sample-Rate", "channels": "X-Channels", "frames": "X-Frames"}  # of the enhanced file


def urls(url: str) -> tuple[str, str]:
    """(REST endpoint, websocket endpoint) of a service address: http(s)://host:port (any path of
    the service's, e.g. /v1/enhance) or ws(s)://host:port[/v1/stream]."""
    p = urllib.parse.urlsplit(url.strip())
    if p.scheme not in ("http", "https", "ws", "wss") or not p.netloc:
        raise ClientError("invalid_url", f"{url!r} is not the service's address; give http://HOST:PORT (or "
                          "ws://HOST:PORT/v1/stream)")
    secure = p.scheme in ("https", "wss")
    base = p.path.rstrip("/")
    for known in (REST_PATH, STREAM_PATH):
        if base.endswith(known):
            base = base[: -len(known)]
    http = urllib.parse.urlunsplit(("https" if secure else "http", p.netloc, base + REST_PATH, "", ""))
    ws = urllib.parse.urlunsplit(("wss" if secure else "ws", p.netloc, base + STREAM_PATH, "", ""))
    return http, ws


def check_options(options: dict) -> dict:
    """The enhancement options given (None left out), or TypeError for one that does not exist."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; the options are {', '.join(OPTIONS)}")
    return {k: v for k, v in options.items() if v is not None}


def output_format_name(dst: Path, info: AudioInfo, src: Path, fmt: str | None) -> str | None:
    """REST's `format` for writing `dst` (its extension or `fmt`, the command line's rules), or None
    for the input's own container."""
    major, _ = output_format_for_path(dst, info, src, fmt)
    if major == info.format:
        return None
    return next(name for name, m in OUTPUT_FORMATS.items() if m == major)


class Client:
    """The service at `url` (`http://HOST:PORT`), with `api_key` when it wants one.

    `max_retries` (in a row, without progress) and `max_wait_s` bound the waits on a full or
    restarting service; `timeout_s`: how long a REST answer may take."""

    def __init__(self, url: str = DEFAULT_URL, api_key: str | None = None, *, max_retries: int = 10,
                 max_wait_s: float = 30.0, timeout_s: float = 600.0):
        self.rest_url, self.ws_url = urls(url)
        self.api_key = api_key
        self.max_retries, self.max_wait_s, self.timeout_s = max_retries, max_wait_s, timeout_s

    @property
    def headers(self) -> dict:
        return {"X-API-Key": self.api_key} if self.api_key else {}

    # ------------------------------------------------------------------ REST
    def enhance_file(self, src, dst, *, format: str | None = None, **options) -> dict:
        """Enhance the file `src` into `dst` over REST: the same rate, channels and length; the
        container `dst`'s extension names (or `format`, as `enhancer denoise`). `options`:
        `atten_lim_db`, `band`, `level`. The file is checked here first (the command line's errors);
        a full or restarting service is waited for. Returns the file's facts."""
        src, dst = Path(src), Path(dst)
        params = check_options(options)
        info = check_file(src)
        name = output_format_name(dst, info, src, format)
        if name:
            params["format"] = name
        query = urllib.parse.urlencode(params)
        headers = self.headers | {"Content-Type": MEDIA_TYPES.get(info.format, "application/octet-stream"),
                                  "Content-Length": str(src.stat().st_size)}
        tries = 0
        while True:
            try:
                status, head, body = self._post(src, query, headers, dst)
            except OSError as e:
                raise ClientError("unreachable", f"cannot reach the service at {self.rest_url}: "
                                  f"{e.strerror or e}; is it running?") from None
            if status == 200:
                return {"path": str(dst)} | {k: int(head.get(h, 0)) for k, h in FACTS.items()}
            err = _http_error(status, head, body)
            if err.kind not in RETRIED or tries >= self.max_retries:
                raise err
            tries += 1
            time.sleep(min(err.retry_after_s or 1.0, self.max_wait_s))

    def _post(self, src: Path, query: str, headers: dict, dst: Path):
        """POST the file; (status, headers, error body), the answer of 200 saved to `dst`. An answer
        the service gives before it read the whole upload (an error: a bad key, a full service) is
        read after the upload is cut short."""
        import http.client

        p = urllib.parse.urlsplit(self.rest_url)
        kind = http.client.HTTPSConnection if p.scheme == "https" else http.client.HTTPConnection
        conn = kind(p.netloc, timeout=self.timeout_s)
        try:
            conn.putrequest("POST", p.path + (f"?{query}" if query else ""))
            for k, v in headers.items():
                conn.putheader(k, v)
            conn.endheaders()
            try:
                with src.open("rb") as f:
                    while data := f.read(1 << 16):
                        conn.send(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # it answered early: the answer says why
            r = conn.getresponse()
            if r.status != 200:
                return r.status, r.headers, r.read()
            self._save(r, dst)
            return r.status, r.headers, b""
        finally:
            conn.close()

    @staticmethod
    def _save(r, dst: Path) -> None:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".part")
        try:
            with tmp.open("wb") as out:
                while data := r.read(1 << 16):
                    out.write(data)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        tmp.replace(dst)

    # ------------------------------------------------------------------ websocket
    def stream(self, sample_rate: int, channels: int = 1, *, metadata: bool = False, on_message=None,
               resume_overlap_s: float = 1.0, **options):
        """A live stream (an async context manager, `enhancer.client_stream.Stream`): `send` PCM of
        any size ((n,) or (n, channels), float or int16), iterate over the enhanced PCM (the same
        shape convention; mono is (n,)), `end` when the input is over. `options`: `atten_lim_db`,
        `band`, `level`; `metadata=True` asks for the per-hop speech activity and competition
        (`on_message` gets every JSON message: ready, metadata, late, gap, end, error)."""
        start = {"sample_rate": sample_rate, "encoding": "f32le", "channels": channels, "metadata": bool(metadata)}
        return Stream(self.ws_url, self.headers, start | check_options(options), on_message=on_message,
                      resume_overlap_s=resume_overlap_s, max_retries=self.max_retries, max_wait_s=self.max_wait_s)

    async def stream_file(self, src, dst, *, speed: float = 1.0, chunk_ms: int = 20, format: str | None = None,
                          on_message=None, **options) -> dict:
        """Stream the file `src` through the websocket as a live source would, `speed` times real
        time (0: as fast as the service takes it), and write the enhanced audio to `dst` (the
        container of its extension, or `format`, as `enhancer denoise`). Returns the file's facts."""
        return await stream_file(self, Path(src), Path(dst), speed=speed, chunk_ms=chunk_ms, format=format,
                                 on_message=on_message, options=check_options(options))


def _http_error(status: int, headers, data: bytes) -> ClientError:
    try:
        body = json.loads(data or b"null")
    except ValueError:
        body = None
    retry = headers.get("Retry-After")
    return ClientError.from_body(status, body, float(retry) if retry and retry.isdigit() else None)


async def enhance_stream(audio: np.ndarray, sample_rate: int, url: str = DEFAULT_URL, *, api_key: str | None = None,
                         speed: float = 1.0, chunk_ms: int = 20, max_wait_s: float = 30.0, max_retries: int = 10,
                         resume_overlap_s: float = 1.0, on_message=None, **options) -> np.ndarray:
    """Enhance `audio` ((n,) or (n, channels)) through the websocket, sent in `chunk_ms` chunks at
    `speed` times real time; the result has its shape. `options`: `atten_lim_db`, `band`, `level`."""
    x = np.asarray(audio)
    channels = 1 if x.ndim == 1 else x.shape[1]
    client = Client(url, api_key, max_retries=max_retries, max_wait_s=max_wait_s)
    step = max(1, int(sample_rate) * chunk_ms // 1000)
    async with client.stream(sample_rate, channels, on_message=on_message, resume_overlap_s=resume_overlap_s,
                             **options) as s:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for i in range(0, len(x), step):
            await s.send(x[i:i + step])
            if speed > 0:
                await asyncio.sleep(max(0.0, t0 + (i + step) / sample_rate / speed - loop.time()))
        y = await s.finish()
    return y.reshape(x.shape)
