"""A real server (uvicorn on a loopback port, in a thread) on the session's test model."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

import server
from server.settings import Settings


class LiveServer:
    """uvicorn serving `create_app(settings)` on 127.0.0.1:<free port> in a background thread."""

    def __init__(self, **settings):
        self.settings = Settings.build(**settings)
        self.app = server.create_app(self.settings)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # as server.serving.listen does: a restart on this port binds while old connections linger
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/stream"
        self.server = server.Server(server.uvicorn_config(self.app, self.settings, port=self.port, log_level="warning"),
                                    self.app)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.02)

    @property
    def scheduler(self):
        return self.app.state.scheduler

    @property
    def metrics(self):
        return self.app.state.metrics

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until every job (stream or file) is released and every worker holds no job and no lane."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            s = self.scheduler
            if not s.jobs and all(not w.jobs and w.pool.n_free == w.pool.capacity for w in s.workers):
                return
            time.sleep(0.02)
        raise AssertionError(f"server not idle: jobs={list(self.scheduler.jobs)}, "
                             f"worker jobs={[len(w.jobs) for w in self.scheduler.workers]}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


# Limits small enough to hit in a test, large enough for the round trips. The capacity is fixed (no
# calibration: tests do not depend on this machine's speed; max_streams caps it), and so late that no
# stream is told it is late or skips its backlog on a busy machine (tests/server/test_capacity.py
# covers those with a deliberately slow step).
TEST_LIMITS = dict(device="cpu", workers=1, max_streams=24, capacity=64, lateness_budget_ms=30_000.0,
                   max_lateness_ms=60_000.0, max_rest_jobs=4, max_upload_bytes=3_000_000,
                   max_duration_s=30.0, rest_chunk_s=0.25, max_message_bytes=200_000, idle_timeout_s=3.0)


@pytest.fixture(scope="session")
def live(model_path):
    srv = LiveServer(model=model_path, **TEST_LIMITS)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def live_auth(model_path):
    srv = LiveServer(model=model_path, **(TEST_LIMITS | dict(api_key="s3cret-key", max_streams=2, max_rest_jobs=1,
                                                        idle_timeout_s=1.0)))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def http(live):
    with httpx.Client(base_url=live.base, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def browser_available():
    """Chromium for the demo page's tests (tests/server/browser.py), or a skip."""
    from .browser import require_browser

    require_browser()
