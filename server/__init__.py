"""The tim-enhancer service: REST and websocket streaming over batched ONNX inference.

    import server
    server.run(host="127.0.0.1", port=8000)            # what `enhancer serve` calls (server.cli)
    app = server.create_app(server.Settings.build())   # the ASGI app (tests, other servers)

No torch in this package: inference is `enhancer.runtime` (numpy + onnxruntime). Importing the
package imports neither uvicorn nor FastAPI (the `enhancer` command loads `server.cli` to list its
`serve` sub-command); `Server`, `StartupError` and `uvicorn_config` come from `serving` on first use.
"""
from __future__ import annotations

from pathlib import Path

from server.settings import Settings

__all__ = ["Server", "Settings", "StartupError", "create_app", "run", "uvicorn_config"]
_SERVING = ("Server", "StartupError", "uvicorn_config")


def create_app(settings: Settings | None = None):
    from server.api.app import create_app as _create

    return _create(settings)


def run(host: str = "127.0.0.1", port: int = 8000, model=None, device: str = "auto", workers: int | None = None,
        max_streams: int = 64, api_key: str | None = None, **limits) -> None:
    """Serve until SIGTERM / SIGINT, then drain the live streams (see `serving`). `model`: path of
    an exported step graph (default: the shipped model); `workers` None: one per CPU this process may
    use; `api_key` (or $TIM_ENHANCER_API_KEY) protects /v1/*, or `api_keys_file` names keys with their
    own limits; `limits`: other `Settings` fields (max_upload_bytes, max_duration_s, idle_timeout_s,
    max_message_bytes, max_messages_per_s, cors_origins, ssl_certfile, ssl_keyfile ...)."""
    from enhancer.errors import CheckpointError
    from enhancer.runtime import default_model_path
    from server.serving import StartupError, serve

    path = Path(model) if model is not None else default_model_path()
    if not path.is_file():
        hint = "" if model is not None else " (the shipped model; pass --model PATH or set $TIM_ENHANCER_MODEL)"
        raise CheckpointError(f"model file not found: {path}{hint}")
    try:
        settings = Settings.build(model=path, device=device, workers=workers, max_streams=max_streams,
                                  api_key=api_key, **limits)
    except ValueError as e:  # an invalid setting, named: `enhancer serve` prints it without a traceback
        raise StartupError(str(e)) from None
    serve(create_app(settings), settings, host, port)


def __getattr__(name):
    if name in _SERVING:
        from server import serving

        return getattr(serving, name)
    raise AttributeError(f"module 'server' has no attribute {name!r}")
