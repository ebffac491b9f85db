"""Rotating the API keys without a restart: the key file is read again on SIGHUP and on `POST
/v1/admin/reload` (an admin key only; `server.api.auth`; the route exists only with a key file).

A new file takes effect at once for new requests and streams. The live streams of a key no longer
in the file finish their session (`removed_streams = "finish"`, the default) or are closed at once
with the `forbidden` error, close 1008 and a reason that says so (`"close"`). A file that cannot be
read or is malformed changes nothing: the keys in force stay, the error (with the line at fault)
is logged, counted (`tim_key_reloads_total{result="error"}`) and, for the route, answered 422
`invalid_key_file`.
"""
from __future__ import annotations

import asyncio
import logging
import signal

from fastapi import APIRouter, Depends, Request

from server.api.auth import require_api_key
from server.api.keyfile import KeyFileError
from server.api.keys import SCOPE_KEY
from server.errors import ErrorKind, ServiceError

log = logging.getLogger("tim_enhancer.server")

router = APIRouter()
REMOVED_MESSAGE = "this API key was removed from the server's key file; the stream was closed"


def reload_keys(app, origin: str) -> dict:
    """Read the key file again and apply it to the live streams; what was done, or ServiceError
    (not_found: no key file; invalid_key_file: the old keys stay)."""
    keys = app.state.keys
    if keys.file is None:
        raise ServiceError(ErrorKind.NOT_FOUND, "no key file to reload: the server was started without --api-keys")
    try:
        old, new = keys.reload()
    except KeyFileError as e:
        log.error("%s: the key file was not reloaded, the %d key name(s) in force stay: %s", origin,
                  len(keys.ring.keys), e)
        raise ServiceError(ErrorKind.INVALID_KEY_FILE, f"{e}; the keys in force were kept") from None
    removed = old.digests - new.digests
    streams = [s for s in app.state.sessions if not s.finished.is_set()
               and getattr(s.ws.scope.get(SCOPE_KEY), "digest", None) in removed]
    if new.removed_streams == "close":
        for s in streams:
            s.drain(ServiceError(ErrorKind.FORBIDDEN, REMOVED_MESSAGE))
    gone = sorted(set(old.names) - set(new.names))
    log.info("%s: key file reloaded: %d name(s) (%s)%s; %d live stream(s) of removed keys %s", origin,
             len(new.keys), ", ".join(new.names), f", removed: {', '.join(gone)}" if gone else "", len(streams),
             "closed" if new.removed_streams == "close" else "finish their session")
    return {"reloaded": True, "keys": new.names, "removed": gone, "removed_streams": new.removed_streams,
            "streams_of_removed_keys": len(streams)}


def on_sighup(app) -> None:
    """SIGHUP: reload the key file; failures are logged (the keys in force stay)."""
    try:
        reload_keys(app, "SIGHUP")
    except ServiceError as e:
        if e.kind == ErrorKind.NOT_FOUND:
            log.info("SIGHUP: %s", e.message)


def install_sighup(app) -> bool:
    """Reload on SIGHUP from now on, draining included (the event loop's signal handler, removed when
    the loop closes; only in the main thread). SIGHUP no longer ends the process."""
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_sighup, app)
    except (ValueError, RuntimeError, NotImplementedError, AttributeError):  # not the main thread, or no SIGHUP
        return False
    return True


RESPONSES = {
    401: {"description": "API key missing"},
    403: {"description": "API key wrong, or not an admin key"},
    422: {"description": "The key file is malformed (the error names the line); the keys in force were kept"},
}


@router.post("/v1/admin/reload", tags=["operations"], summary="Read the API key file again",
             dependencies=[Depends(require_api_key)], responses=RESPONSES)
async def reload(request: Request) -> dict:
    """Rotate keys without a restart: the key file (`--api-keys`) is read again and takes effect at
    once; streams of removed keys finish or are closed, as the file's `removed_streams` says."""
    match = request.scope.get(SCOPE_KEY)
    if match is None or not match.admin:
        raise ServiceError(ErrorKind.FORBIDDEN, "this needs an admin key (admin = true in the key file)")
    return reload_keys(request.app, "POST /v1/admin/reload")
