"""Headless Chromium driven over the DevTools protocol (a tiny client on `websockets`)."""
from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from websockets.sync.client import connect


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


class Chromium:
    """One headless browser with a fake microphone playing `audio_file` and one page at `url`.

    Every uncaught page error, console error and failed resource load (e.g. a 404 favicon) from the
    first request on is recorded: `errors()` lists them."""

    def __init__(self, url: str, audio_file: Path, width: int = 1100, height: int = 820):
        self.profile = tempfile.mkdtemp(prefix="tim-chromium-")
        args = [chromium_path(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
                "--remote-debugging-address=127.0.0.1", "--use-fake-ui-for-media-stream",
                "--use-fake-device-for-media-stream", f"--use-file-for-fake-audio-capture={audio_file}",
                "--autoplay-policy=no-user-gesture-required", f"--window-size={width},{height}", "about:blank"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self.ws = connect(self._page_ws_url("about:blank"), max_size=None, open_timeout=20).__enter__()
        self._ids = itertools.count(1)
        self.events: list[dict] = []
        for domain in ("Runtime", "Log", "Page"):  # before the page loads, so nothing is missed
            self.call(f"{domain}.enable")
        self.call("Page.navigate", url=url)

    def _page_ws_url(self, url: str, timeout: float = 30.0) -> str:
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited: {self.proc.stderr.read().decode()[-2000:]}")
            if port_file.is_file() and port_file.read_text().strip():
                port = port_file.read_text().split()[0]
                try:
                    pages = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=2).json()
                except httpx.HTTPError:
                    pages = []
                for p in pages:
                    if p.get("type") == "page" and p.get("url", "").startswith(url.rstrip("/")):
                        return p["webSocketDebuggerUrl"]
            time.sleep(0.1)
        raise RuntimeError("chromium's DevTools endpoint did not come up")

    def call(self, method: str, timeout: float = 30.0, **params) -> dict:
        i = next(self._ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        deadline = time.time() + timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(deadline - time.time(), 0.01)))
            if "method" in msg:
                self.events.append(msg)
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def evaluate(self, expression: str, user_gesture: bool = False):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True,
                      userGesture=user_gesture)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page error: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0, interval: float = 0.2):
        deadline = time.time() + timeout
        value = None
        while time.time() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(interval)
        return value

    def pump(self, seconds: float) -> None:
        """Let the page run for `seconds`, recording its events."""
        deadline = time.time() + seconds
        while (left := deadline - time.time()) > 0:
            try:
                msg = json.loads(self.ws.recv(timeout=left))
            except TimeoutError:
                break
            if "method" in msg:
                self.events.append(msg)

    def errors(self) -> list[str]:
        """Uncaught exceptions, console.error/assert calls and error log entries (failed loads) so far."""
        out = []
        for e in self.events:
            m, p = e["method"], e.get("params", {})
            if m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                out.append(f"uncaught: {d.get('exception', {}).get('description') or d.get('text')}")
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(f"console.{p['type']}: " + " ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                entry = p["entry"]
                out.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".rstrip())
        return out

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:  # noqa: BLE001
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the browser's own process group, started above
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        shutil.rmtree(self.profile, ignore_errors=True)
