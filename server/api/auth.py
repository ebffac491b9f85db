"""Optional API key, enforced by one ASGI middleware on every route except health and the demo's
static documents.

The key goes in the `X-API-Key` header; websocket handshakes and GET requests (browsers cannot set
headers there) may use the `?api_key=` query instead. A missing key is 401 / close 1008
`unauthorized`, a wrong one 403 / 1008 `forbidden`. Unknown paths need the key too, so that an
unauthenticated client learns nothing about which routes exist.
"""
from __future__ import annotations

import hmac
import json

from fastapi import Request, Security
from fastapi.security import APIKeyHeader
from starlette.datastructures import Headers, QueryParams

from server.errors import ErrorKind, ServiceError

HEADER = "X-API-Key"
QUERY = "api_key"
# Open without a key: liveness and readiness probes, the browser module /client.js and the browser
# demo's page and assets (static files of this package, no data; the page asks for the key and
# sends it with the websocket).
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/", "/client.js"})
PUBLIC_PREFIXES = ("/static/",)

api_key_header = APIKeyHeader(name=HEADER, auto_error=False, description="Required when the server has an API key")


def check_key(expected: str | None, given: str | None) -> None:
    """Raise ServiceError unauthorized (missing) or forbidden (wrong) when a key is configured."""
    if expected is None:
        return
    if not given:
        raise ServiceError(ErrorKind.UNAUTHORIZED, f"an API key is required: send the {HEADER} header")
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise ServiceError(ErrorKind.FORBIDDEN, "the API key is not valid")


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def given_key(scope) -> str | None:
    """The key a request carries: the header, or (websocket, GET, HEAD) the query parameter."""
    key = Headers(scope=scope).get(HEADER)
    if key is None and (scope["type"] == "websocket" or scope.get("method") in ("GET", "HEAD")):
        key = QueryParams(scope.get("query_string", b"")).get(QUERY)
    return key


class ApiKeyMiddleware:
    """Pure ASGI: rejects requests without the right key before any route, body or upgrade runs."""

    def __init__(self, app, api_key: str | None, metrics=None):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send):
        if (self.api_key is None or scope["type"] not in ("http", "websocket") or is_public(scope["path"])
                or scope.get("method") == "OPTIONS"):  # CORS preflights carry no credentials
            return await self.app(scope, receive, send)
        try:
            check_key(self.api_key, given_key(scope))
        except ServiceError as e:
            if self.metrics is not None:
                self.metrics.errors.labels(kind=e.kind).inc()
            if scope["type"] == "http":
                await _http_error(send, e)
            else:
                await _ws_error(receive, send, e)
            return
        await self.app(scope, receive, send)


async def _http_error(send, e: ServiceError) -> None:
    body = json.dumps(e.rest_body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
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
    check_key(request.app.state.settings.api_key, key)
