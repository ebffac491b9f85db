"""Running the app under uvicorn: start-up errors in plain words, protocols that drop stalled
clients, TLS when a certificate is given, the HAProxy agent port, the key file re-read on SIGHUP
(`server.api.admin`), and a graceful drain on SIGTERM / SIGINT.

Shutdown order: the signal -> draining at once (`server.drain.begin`: /readyz 503, agent `drain`,
new streams and uploads refused, still listening, /healthz 200) -> `Server.shutdown`: streams run
on and uploads in flight finish, until none is left or `drain_timeout_s` has passed; the streams
still open then get the enhanced tail of all they sent, `{"type": "end", "samples": n, "reason":
"shutdown", ...}` and close 1012 -> the listening sockets and the agent close -> uvicorn waits
for uploads still running (again at most `drain_timeout_s`) -> the inference workers stop.
"""
from __future__ import annotations

import errno
import logging
import socket
import ssl

import uvicorn

from enhancer.errors import EnhancerError
from server import drain
from server.errors import ErrorKind
from server.settings import Settings
from server.stalls import freeze_startup_objects

log = logging.getLogger("tim_enhancer.server")


class StartupError(EnhancerError, RuntimeError):
    """The service cannot start (device unavailable, address in use ...); `enhancer serve` prints
    the message and exits non-zero."""


def uvicorn_config(app, settings: Settings, host: str = "127.0.0.1", port: int = 8000, **kwargs) -> uvicorn.Config:
    """uvicorn settings that match the service's limits. A websocket message over
    `max_message_bytes` always gets the documented answer (JSON error `too_large`, then close
    1009): up to the protocol's frame cap (the limit + 64 KiB) the handler checks the whole message;
    a bigger frame is refused from its header, before its payload is read, by the protocol layer
    with the same answer (`protocols.OversizeAnswer`). A connection buffers at most one message of
    about the limit."""
    from server.logs import log_config
    from server.protocols import protocol_classes

    metrics = getattr(getattr(app, "state", None), "metrics", None)
    on_stall = metrics.stalled.inc if metrics is not None else None
    on_too_large = metrics.errors.labels(kind=ErrorKind.TOO_LARGE).inc if metrics is not None else None
    # per-message deflate is off: PCM barely compresses, and compressing costs CPU the streams need.
    # Keepalive pings without a pong deadline: while a stream is held back (its audio waits for
    # inference), uvicorn stops reading its socket and cannot see pongs, so a deadline would close
    # busy streams with a misleading 1011 "keepalive ping timeout". Dead peers are still found: by
    # idle_timeout_s while reading, by the stall guard while output waits.
    options = dict(host=host, port=port, ws_max_size=settings.max_message_bytes + 65536, ws_ping_timeout=None,
                   log_level="info", ws_per_message_deflate=False, log_config=log_config(),
                   timeout_graceful_shutdown=settings.drain_timeout_s, proxy_headers=False, server_header=False,
                   **protocol_classes(settings.idle_timeout_s, on_stall, settings.max_message_bytes, on_too_large))
    if settings.ssl_certfile is not None:  # https and wss; the agent port stays plain TCP (HAProxy reads it so)
        options |= dict(ssl_certfile=str(settings.ssl_certfile), ssl_keyfile=str(settings.ssl_keyfile))
    return uvicorn.Config(app, **(options | kwargs))


def check_tls(settings: Settings) -> None:
    """StartupError unless the certificate and its key load (uvicorn would fail later, with a traceback)."""
    cert, key = settings.ssl_certfile, settings.ssl_keyfile
    if cert is None:
        return
    why = None
    try:
        for path, marker, what in ((cert, "-----BEGIN CERTIFICATE-----", "no PEM certificate"),
                                   (key, "PRIVATE KEY-----", "no PEM private key")):
            if marker not in path.read_text(errors="replace"):
                why = f"{path.name} holds {what}"
                break
        else:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except ssl.SSLError as e:
        why = "the key is not the certificate's" if e.reason == "KEY_VALUES_MISMATCH" else str(e)
    except OSError as e:
        why = (e.strerror or str(e)).lower()
    if why is not None:
        raise StartupError(f"cannot load the TLS certificate {cert} with the key {key}: {why}")


class Server(uvicorn.Server):
    """uvicorn.Server that drains the app (`server.drain`) before uvicorn closes its connections,
    and serves the HAProxy agent (`server.agent`) when `agent_port` is set (on `agent_sock` when
    given, bound already)."""

    def __init__(self, config: uvicorn.Config, app, agent_sock: socket.socket | None = None):
        super().__init__(config)
        self.app = app
        self.agent_sock = agent_sock
        self.agent = None

    def handle_exit(self, sig, frame) -> None:
        drain.begin(self.app)  # /readyz 503 and agent `drain` from the signal on, not from the next tick
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        await drain.run(self.app, self.app.state.settings.drain_timeout_s, lambda: self.force_exit)
        await drain.flush(self.server_state.connections)  # the streams' last messages reach their clients
        for server in self.servers:  # still listening until here: probes see 503 / 200, not refused connections
            server.close()
        if self.agent is not None:
            await self.agent.close()
        await super().shutdown(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        settings = self.app.state.settings
        if self.started and (self.agent_sock is not None or settings.agent_port is not None):
            from server.agent import Agent

            self.agent = Agent(self.app, self.agent_sock, self.config.host, settings.agent_port or 0)
            await self.agent.start()
        if self.started:
            from server.api.admin import install_sighup

            keys = self.app.state.keys
            if install_sighup(self.app) and keys.file is not None:  # the key file is re-read on SIGHUP (main thread)
                log.info("API keys: %d name(s) from %s (%s); SIGHUP or POST /v1/admin/reload reads it again",
                         len(keys.ring.keys), keys.file, ", ".join(keys.ring.names))
            scheduler = self.app.state.scheduler
            host = self.config.host
            port = sockets[0].getsockname()[1] if sockets else self.config.port
            scheme = "https" if settings.ssl_certfile is not None else "http"
            url = f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}/"
            cap = scheduler.capacity
            log.info("ready: demo at %s; provider %s, %d worker(s), capacity %d live stream(s) (%s)", url,
                     scheduler.enhancer.provider, len(scheduler.workers), cap.streams,
                     "measured" if cap.calibrated else "fixed")


def listen(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A bound socket for uvicorn, or StartupError saying why not (a port in use: which `flag` to
    change)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
    except OSError as e:
        sock.close()
        reason = (e.strerror or str(e)).lower()
        if e.errno == errno.EADDRINUSE:  # another service (or this one, already running) holds the port
            make = f" (make serve PORT={port + 1})" if flag == "--port" else ""
            reason += f"; is the service already running? Choose another port: {flag} {port + 1}{make}"
        raise StartupError(f"cannot listen on {host}:{port}: {reason}") from None
    sock.set_inheritable(True)
    return sock


def serve(app, settings: Settings, host: str, port: int) -> None:
    """Start the inference workers, bind, serve until SIGTERM / SIGINT, drain, stop."""
    check_tls(settings)
    scheduler = app.state.scheduler
    try:
        scheduler.start()  # model or device problems surface here as plain errors
    except EnhancerError:
        raise
    except RuntimeError as e:
        raise StartupError(str(e)) from None
    # what start-up allocated lives as long as the process: keep it out of every full collection,
    # which would otherwise stop all streams for tens of milliseconds (see server.stalls)
    freeze_startup_objects()
    socks: list[socket.socket] = []
    try:
        socks.append(listen(host, port))
        if settings.agent_port is not None:
            socks.append(listen(host, settings.agent_port, "--agent-port"))
    except StartupError:
        for s in socks:
            s.close()
        scheduler.stop()
        raise
    try:
        Server(uvicorn_config(app, settings, host, port), app, socks[1] if len(socks) > 1 else None).run(
            sockets=socks[:1])
    finally:
        for s in socks:
            s.close()
