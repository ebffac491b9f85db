"""Start a server process on a free loopback port for the benchmark, soak and fuzz commands.

Its log goes to a file (a pipe nobody reads would fill up and stall the server), and it is
stopped with SIGTERM if the command that started it dies.
"""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import REPO_ROOT


def _die_with_parent() -> None:  # runs in the child before exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ServerProcess:
    def __init__(self, model: Path, **settings):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.base = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/stream"
        self.log = Path(tempfile.mkstemp(prefix="tim-server-", suffix=".log")[1])
        code = (f"import server; server.run(host='127.0.0.1', port={self.port}, model={str(model)!r}, "
                f"**{settings!r})")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                                         stderr=log, preexec_fn=_die_with_parent)
        self.pid = self.proc.pid

    def log_tail(self, n: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        if poll_ready(self.proc, self.base, timeout):
            return self
        if self.proc.poll() is not None:
            raise SystemExit(f"server exited ({self.proc.returncode}): {self.log_tail()}")
        self.proc.kill()
        raise SystemExit("server did not become ready in time")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        return terminate(self.proc)


def poll_ready(proc: subprocess.Popen, base: str, timeout: float = 120.0, verify=False) -> bool:
    """Poll `base`/readyz every 0.2 s until it answers 200 (True), `proc` exits or `timeout` passes
    (False); through one client for all polls: `httpx.get` builds a TLS context per call (tens of ms
    of CPU each), CPU the server would lose while it times its capacity, and then it would measure
    less than the machine holds. `verify`: httpx's (an ssl context for https with a test CA)."""
    import httpx

    deadline = time.time() + timeout
    with httpx.Client(timeout=1, verify=verify) as client:
        while time.time() < deadline:
            if proc.poll() is not None:
                return False
            try:
                if client.get(base + "/readyz").status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    return False


def terminate(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM (a server's drain), SIGKILL after `timeout`; the exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def start(model: Path, **settings) -> ServerProcess:
    return ServerProcess(model, **settings).wait_ready()
