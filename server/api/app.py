"""The FastAPI application: routes, error handlers, lifecycle of the inference workers."""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

import enhancer
from enhancer.errors import EnhancerError
from server.api import admin, rest, ws
from server.api.auth import QUERY, ApiKeyMiddleware
from server.api.keys import Keys
from server.errors import ErrorKind, ServiceError, from_core
from server.metrics import Metrics
from server.scheduling.scheduler import Scheduler
from server.settings import Settings
from server.stalls import GcTimer, LoopLagMonitor

log = logging.getLogger("tim_enhancer.server")
STATIC = Path(__file__).resolve().parents[1] / "static"  # package data: server.static

DESCRIPTION = """Real-time speech enhancement with a causal Transformer with Independent Mechanisms (TIM).

* `POST /v1/enhance` enhances an audio file (same rate, channels and length back).
* `GET /v1/stream` (websocket) enhances live audio; see the README's *Streaming* section for the protocol.
* `/healthz`, `/readyz`, `/metrics` for operations; `/` is a browser demo.
"""


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app for `settings`; inference workers start with the app's lifespan."""
    settings = settings or Settings.build()
    metrics = Metrics()
    keys = Keys(settings, metrics)  # a malformed key file stops the start here (KeyFileError, naming the line)
    scheduler = Scheduler(settings, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not scheduler.workers:  # `server.run` starts it before uvicorn, to report load errors plainly
            await run_in_threadpool(scheduler.start)  # loading sessions takes a moment: not on the loop
        log.info("model %s on %s, %d worker(s), capacity %d live stream(s) (%s)", scheduler.enhancer.config.name,
                 scheduler.enhancer.provider, len(scheduler.workers), scheduler.capacity.streams,
                 "measured" if scheduler.capacity.calibrated else "fixed")
        lag, gc_timer = LoopLagMonitor(metrics.loop_lag), GcTimer(metrics.gc_pause)
        lag.start()
        gc_timer.install()
        follow = asyncio.create_task(scheduler.follow(), name="tim-capacity")  # re-estimates the capacity
        try:
            yield
        finally:
            follow.cancel()
            await asyncio.gather(follow, return_exceptions=True)
            gc_timer.uninstall()
            await lag.stop()
            await run_in_threadpool(scheduler.stop)

    app = FastAPI(title="tim-enhancer", version=enhancer.__version__, description=DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.settings, app.state.metrics, app.state.scheduler, app.state.keys = settings, metrics, scheduler, keys
    app.state.sessions = set()  # open websocket streams (StreamSession)
    app.state.draining = False  # set on SIGTERM (server.drain): /readyz 503, new streams and uploads refused
    app.state.uploads = 0  # POST /v1/enhance requests in flight (RestMetricsMiddleware): the drain waits for them
    # middleware: the last added runs first. Metrics see every answer; CORS answers preflights and
    # decorates errors; the API key is checked before any route runs.
    app.add_middleware(ApiKeyMiddleware, keys=keys)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Content-Type", "X-API-Key"],
                           expose_headers=["X-Sample-Rate", "X-Channels", "X-Frames"])
    app.add_middleware(RestMetricsMiddleware, metrics=metrics)
    _add_error_handlers(app, metrics)
    app.include_router(rest.router)
    app.include_router(ws.router)
    if keys.file is not None:  # POST /v1/admin/reload: only where there is a key file to read again
        app.include_router(admin.router)
    _add_operations(app, metrics)
    _add_demo(app)
    return app


def _add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(ServiceError)
    async def service_error(request: Request, e: ServiceError, headers: dict | None = None):
        metrics.errors.labels(kind=e.kind).inc()
        request.app.state.keys.note_error(request.scope, e)  # refusals per API key
        if e.retry_after_header is not None:
            headers = (headers or {}) | {"Retry-After": e.retry_after_header}
        return JSONResponse(e.rest_body(), status_code=e.status, headers=headers)

    @app.exception_handler(EnhancerError)
    async def core_error(request: Request, e: EnhancerError):
        return await service_error(request, from_core(e))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        parts = []
        for err in e.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p not in ("query", "body"))
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return await service_error(request, ServiceError(ErrorKind.INVALID_PARAMETER, "; ".join(parts) or "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "bad_request")
        message = {"not_found": "no such route", "method_not_allowed": f"{request.method} is not allowed here"
                   }.get(kind, "malformed request")
        return await service_error(request, ServiceError(kind, message), headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("request failed")
        return await service_error(request, ServiceError(ErrorKind.INTERNAL, "internal error"))


def _add_operations(app: FastAPI, metrics: Metrics) -> None:
    @app.get("/healthz", tags=["operations"], summary="Liveness: the process answers")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", tags=["operations"], summary="Readiness: model loaded, workers running",
             responses={503: {"description": "Not ready (model loading or a worker stopped)"}})
    async def readyz(request: Request):
        scheduler = request.app.state.scheduler
        if request.app.state.draining:
            return JSONResponse({"ready": False, "draining": True}, status_code=503)
        if not scheduler.ready:
            return JSONResponse({"ready": False}, status_code=503)
        enh = scheduler.enhancer
        cfg = enh.config
        return {
            "ready": True, "model": cfg.name, "model_file": enh.engine.path.name, "provider": enh.provider,
            "parameters": enh.engine.parameters, "workers": len(scheduler.workers),
            "sample_rate": cfg.stft.sample_rate, "hop_ms": 1000.0 * cfg.stft.hop / cfg.stft.sample_rate,
            "latency_ms": cfg.algorithmic_latency_ms, "active_streams": scheduler.streams,
            "capacity": scheduler.admission.public() | (scheduler.tracker.public() if scheduler.tracker
                                                         else {"follows": False})
            | {"loop_ms_per_stream": None if scheduler.loop_ms_per_stream is None
               else round(scheduler.loop_ms_per_stream, 3)},
            "limits": request.app.state.settings.public(),
        }

    @app.get("/metrics", tags=["operations"], summary="Prometheus metrics",
             response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)


def _add_demo(app: FastAPI) -> None:
    """The demo page and its assets: a fixed list of this package's files, looked up by name (no
    path from the client reaches the filesystem)."""
    assets = {p.name: p for p in STATIC.iterdir() if p.is_file() and p.name != "index.html"}
    examples = {p.name: p for p in (STATIC / "examples").iterdir() if p.is_file()}  # tools/examples.py's

    @app.get("/", include_in_schema=False)
    async def demo() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    def served(files: dict, name: str) -> FileResponse:
        path = files.get(name)
        if path is None:
            raise ServiceError(ErrorKind.NOT_FOUND, "no such file")
        return FileResponse(path, headers={"Cache-Control": "no-cache"})

    @app.get("/static/examples/{name}", include_in_schema=False)
    async def example(name: str) -> FileResponse:
        return served(examples, name)

    @app.get("/client.js", include_in_schema=False)
    async def client_module() -> FileResponse:
        """The browser module (an ES module): public, and importable by pages of any origin."""
        return FileResponse(STATIC / "client.js", media_type="text/javascript",
                            headers={"Cache-Control": "no-cache", "Access-Control-Allow-Origin": "*"})

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> FileResponse:
        return served(assets, name)

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request):
        """Swagger UI; with ?api_key= (checked by the middleware) it fetches the schema with it."""
        url = app.openapi_url
        key = request.query_params.get(QUERY)
        if key and request.app.state.keys.required:
            url += "?" + urlencode({QUERY: key})
        return get_swagger_ui_html(openapi_url=url, title="tim-enhancer API")


class RestMetricsMiddleware:
    """Counts POST /v1/enhance responses by status and the requests in flight (`app.state.uploads`,
    which the drain waits for); pure ASGI: the response body is not buffered."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") != "/v1/enhance":
            return await self.app(scope, receive, send)
        status = {"code": 500}
        state = scope["app"].state if "app" in scope else None

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        if state is not None:
            state.uploads += 1
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if state is not None:
                state.uploads -= 1
            self.metrics.rest_requests.labels(status=str(status["code"])).inc()
