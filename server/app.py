"""The FastAPI application: routes, error handlers, lifecycle of the inference workers."""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

import enhancer

from . import rest, ws
from .errors import ServiceError
from .metrics import Metrics
from .scheduler import Scheduler
from .settings import Settings

log = logging.getLogger("tim_enhancer.server")
STATIC = Path(__file__).resolve().parent / "static"

DESCRIPTION = """Real-time speech enhancement with a causal Transformer with Independent Mechanisms (TIM).

* `POST /v1/enhance` enhances an audio file (same rate, channels and length back).
* `GET /v1/stream` (websocket) enhances live audio; see the README's *Streaming* section for the protocol.
* `/healthz`, `/readyz`, `/metrics` for operations; `/` is a browser demo.
"""


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app for `settings`; inference workers start with the app's lifespan."""
    settings = settings or Settings.build()
    metrics = Metrics()
    scheduler = Scheduler(settings, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not scheduler.workers:  # `server.run` starts it before uvicorn, to report load errors plainly
            await run_in_threadpool(scheduler.start)  # loading sessions takes a moment: not on the loop
        log.info("model %s on %s, %d worker(s)", scheduler.enhancer.config.name, scheduler.enhancer.provider,
                 len(scheduler.workers))
        try:
            yield
        finally:
            await run_in_threadpool(scheduler.stop)

    app = FastAPI(title="tim-enhancer", version=enhancer.__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.settings, app.state.metrics, app.state.scheduler = settings, metrics, scheduler
    app.state.sessions = set()  # open websocket streams (StreamSession)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Content-Type", "X-API-Key"],
                           expose_headers=["X-Sample-Rate", "X-Channels", "X-Frames"])
    app.add_middleware(RestMetricsMiddleware, metrics=metrics)
    _add_error_handlers(app, metrics)
    app.include_router(rest.router)
    app.include_router(ws.router)
    _add_operations(app, metrics)
    _add_demo(app)
    return app


def _add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(ServiceError)
    async def service_error(request: Request, e: ServiceError):
        metrics.errors.labels(kind=e.kind).inc()
        headers = {"Retry-After": "1"} if e.kind == "over_capacity" else None
        return JSONResponse(e.rest_body(), status_code=e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        parts = []
        for err in e.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p not in ("query", "body"))
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return await service_error(request, ServiceError("invalid_parameter", "; ".join(parts) or "invalid request"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("request failed")
        return await service_error(request, ServiceError("internal", "internal error"))


def _add_operations(app: FastAPI, metrics: Metrics) -> None:
    @app.get("/healthz", tags=["operations"], summary="Liveness: the process answers")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", tags=["operations"], summary="Readiness: model loaded, workers running",
             responses={503: {"description": "Not ready (model loading or a worker stopped)"}})
    async def readyz(request: Request):
        scheduler = request.app.state.scheduler
        if not scheduler.ready:
            return JSONResponse({"ready": False}, status_code=503)
        enh = scheduler.enhancer
        cfg = enh.config
        return {
            "ready": True, "model": cfg.name, "model_path": str(enh.engine.path), "provider": enh.provider,
            "parameters": enh.engine.parameters, "workers": len(scheduler.workers),
            "sample_rate": cfg.stft.sample_rate, "hop_ms": 1000.0 * cfg.stft.hop / cfg.stft.sample_rate,
            "latency_ms": cfg.algorithmic_latency_ms, "active_streams": scheduler.streams,
            "limits": request.app.state.settings.public(),
        }

    @app.get("/metrics", tags=["operations"], summary="Prometheus metrics",
             response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)


def _add_demo(app: FastAPI) -> None:
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def demo() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


class RestMetricsMiddleware:
    """Counts POST /v1/enhance responses by status (pure ASGI: the response body is not buffered)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") != "/v1/enhance":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.rest_requests.labels(status=str(status["code"])).inc()
