"""Optional API keys (one `--api-key`, or a key file: `server.api.keys`), enforced by one ASGI
middleware on every route except health and the demo's static documents.

The key goes in the `X-API-Key` header; websocket handshakes and GET requests (browsers cannot set
headers there) may use the `?api_key=` query instead. A missing key is 401 / close 1008
`unauthorized`, a wrong one 403 / 1008 `forbidden`. Unknown paths need the key too, so that an
unauthenticated client learns nothing about which routes exist. With a key file, `/metrics` and
`/v1/admin/*` need a key marked `admin`, and each `POST /v1/enhance` takes a token of its key's
request rate (429 with Retry-After beyond) before its body is read. The request's key (`keys.Match`:
name and digest, never the key) is left in the scope for the routes.
"""
from __future__ import annotations

import json

from fastapi import Request, Security
from fastapi.security import APIKeyHeader
from starlette.datastructures import Headers, QueryParams

from server.api.keys import SCOPE_KEY, UPLOAD_PATH, Keys
from server.errors import ErrorKind, ServiceError

HEADER = "X-API-Key"
QUERY = "api_key"
# Open without a key: liveness and readiness probes, the browser module /client.js and the browser
# demo's page and assets (static files of this package, no data; the page asks for the key and
# sends it with the websocket).
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/", "/client.js"})
PUBLIC_PREFIXES = ("/static/",)
# with a key file: an admin key only (usage of every key; rotating the keys)
ADMIN_PATHS = frozenset({"/metrics"})
ADMIN_PREFIXES = ("/v1/admin/",)

api_key_header = APIKeyHeader(name=HEADER, auto_error=False, description="Required when the server has an API key")


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def given_key(scope) -> str | None:
    """The key a request carries: the header, or (websocket, GET, HEAD) the query parameter."""
    key = Headers(scope=scope).get(HEADER)
    if key is None and (scope["type"] == "websocket" or scope.get("method") in ("GET", "HEAD")):
        key = QueryParams(scope.get("query_string", b"")).get(QUERY)
    return key


def is_admin_path(path: str) -> bool:
    return path in ADMIN_PATHS or path.startswith(ADMIN_PREFIXES)


class ApiKeyMiddleware:
    """Pure ASGI: rejects requests without a key in force (or over their key's request rate) before
    any route, body or upgrade runs."""

    def __init__(self, app, keys: Keys):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        keys = self.keys
        if (not keys.required or scope["type"] not in ("http", "websocket") or is_public(scope["path"])
                or scope.get("method") == "OPTIONS"):  # CORS preflights carry no credentials
            return await self.app(scope, receive, send)
        upload = scope["type"] == "http" and scope["path"] == UPLOAD_PATH and scope.get("method") == "POST"
        try:
            match = keys.authenticate(given_key(scope), HEADER)
            scope[SCOPE_KEY] = match
            if keys.file is not None and is_admin_path(scope["path"]) and not match.admin:
                raise ServiceError(ErrorKind.FORBIDDEN, "this needs an admin key (admin = true in the key file)")
            if upload:
                keys.take_request(match)
        except ServiceError as e:
            keys.metrics.errors.labels(kind=e.kind).inc()
            keys.note_error(scope, e)
            if scope["type"] == "http":
                if upload:
                    keys.count_request(scope, e.status)
                await _http_error(send, e)
            else:
                await _ws_error(receive, send, e)
            return
        if not upload:
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            keys.count_request(scope, status["code"])


async def _http_error(send, e: ServiceError) -> None:
    body = json.dumps(e.rest_body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if e.retry_after_header is not None:
        headers.append((b"retry-after", e.retry_after_header.encode()))
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _ws_error(receive, send, e: ServiceError) -> None:
    """The protocol's error form: accept, the JSON error, then the close code."""
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": json.dumps(e.ws_message(), separators=(",", ":"))})
    await send({"type": "websocket.close", "code": e.close_code, "reason": e.message[:120]})


async def require_api_key(request: Request, key: str | None = Security(api_key_header)) -> None:
    """FastAPI dependency for REST routes: declares the scheme in the OpenAPI description and
    checks again behind the middleware."""
    request.app.state.keys.authenticate(key, HEADER)
