"""Optional API key: the `X-API-Key` header (REST and websocket) or `?api_key=` (websocket, for browsers)."""
from __future__ import annotations

import hmac

from fastapi import Request, Security
from fastapi.security import APIKeyHeader

from .errors import ServiceError

HEADER = "X-API-Key"
QUERY = "api_key"

api_key_header = APIKeyHeader(name=HEADER, auto_error=False, description="Required when the server has an API key")


def check_key(expected: str | None, given: str | None) -> None:
    """Raise ServiceError unauthorized (missing) or forbidden (wrong) when a key is configured."""
    if expected is None:
        return
    if not given:
        raise ServiceError("unauthorized", f"an API key is required: send the {HEADER} header")
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise ServiceError("forbidden", "the API key is not valid")


async def require_api_key(request: Request, key: str | None = Security(api_key_header)) -> None:
    """FastAPI dependency for REST routes."""
    check_key(request.app.state.settings.api_key, key)
