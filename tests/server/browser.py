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
import pytest
from websockets.sync.client import connect

# Screenshots of the page for people to look at (not committed: /artifacts/ is ignored by git).
ARTIFACTS = Path(os.environ.get("TIM_ARTIFACTS", Path(__file__).resolve().parents[2] / "artifacts"))


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


def require_browser() -> None:
    """Skip the test without Chromium (fail on CI, where `make test` installs it)."""
    if chromium_path() is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (make test installs Debian's chromium when run as root)")
        pytest.skip("chromium is not installed: apt-get install chromium")


# key -> (windows virtual key code, DOM code, text typed)
KEYS = {"Tab": (9, "Tab", ""), "Enter": (13, "Enter", "\r"), " ": (32, "Space", " "), "Escape": (27, "Escape", ""),
        "ArrowLeft": (37, "ArrowLeft", ""), "ArrowUp": (38, "ArrowUp", ""), "ArrowRight": (39, "ArrowRight", ""),
        "ArrowDown": (40, "ArrowDown", "")}


class Chromium:
    """One headless browser with a fake microphone playing `audio_file` (or Chromium's beep when
    None) and one page at `url`.

    Every uncaught page error, console error and failed resource load (e.g. a 404 favicon) from the
    first request on is recorded: `errors()` lists them."""

    def __init__(self, url: str, audio_file: Path | None = None, width: int = 1100, height: int = 820,
                 mobile: bool = False):
        self.profile = tempfile.mkdtemp(prefix="tim-chromium-")
        fake_audio = [f"--use-file-for-fake-audio-capture={audio_file}"] if audio_file else []
        args = [chromium_path(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
                "--remote-debugging-address=127.0.0.1", "--use-fake-ui-for-media-stream",
                "--use-fake-device-for-media-stream", *fake_audio,
                "--autoplay-policy=no-user-gesture-required", f"--window-size={width},{height}", "about:blank"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self.ws = connect(self._page_ws_url("about:blank"), max_size=None, open_timeout=20).__enter__()
        self._ids = itertools.count(1)
        self.events: list[dict] = []
        for domain in ("Runtime", "Log", "Page"):  # before the page loads, so nothing is missed
            self.call(f"{domain}.enable")
        if mobile:  # a phone: its viewport width, touch and the page's viewport meta tag
            self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=2,
                      mobile=True)
            self.call("Emulation.setTouchEmulationEnabled", enabled=True)
        self.call("Emulation.setFocusEmulationEnabled", enabled=True)  # focus and :focus-visible as in a focused window
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

    def wait_event(self, method: str, since: int = 0, timeout: float = 10.0) -> dict | None:
        """The first event `method` recorded at index >= `since` (take `len(page.events)` before the
        action that causes it), waiting up to `timeout` s; None if none came."""
        deadline = time.time() + timeout
        while True:
            for e in self.events[since:]:
                if e["method"] == method:
                    return e
            since = len(self.events)
            left = deadline - time.time()
            if left <= 0:
                return None
            try:
                msg = json.loads(self.ws.recv(timeout=left))
            except TimeoutError:
                return None
            if "method" in msg:
                self.events.append(msg)

    def press(self, key: str, shift: bool = False) -> None:
        """One key pressed and released, as the keyboard would (focus moves on Tab, buttons click on
        Enter and Space)."""
        vk, code, text = KEYS[key]
        common = dict(key=key, code=code, windowsVirtualKeyCode=vk, nativeVirtualKeyCode=vk, modifiers=8 if shift else 0)
        self.call("Input.dispatchKeyEvent", type="keyDown" if text else "rawKeyDown", text=text, **common)
        self.call("Input.dispatchKeyEvent", type="keyUp", **common)

    def tab_to(self, js_test: str, limit: int = 40, shift: bool = False) -> int:
        """Presses Tab until `js_test` (an expression on `document.activeElement`, as `el`) holds;
        returns the number of presses, or raises if it never did within `limit`."""
        for i in range(1, limit + 1):
            self.press("Tab", shift)
            if self.evaluate(f"(el => !!({js_test}))(document.activeElement)"):
                return i
        raise AssertionError(f"{limit} Tab presses never reached {js_test}: focus on "
                             f"{self.evaluate('document.activeElement.outerHTML.slice(0, 120)')}")

    def choose_files(self, trigger, files: list[Path], timeout: float = 10.0) -> None:
        """Answers the file chooser that `trigger()` opens (a click or key press on the page) with
        `files`, as a user picking them in the dialog would."""
        self.call("Page.setInterceptFileChooserDialog", enabled=True)
        since = len(self.events)
        trigger()
        opened = self.wait_event("Page.fileChooserOpened", since, timeout)
        assert opened is not None, "no file chooser opened"
        self.call("DOM.setFileInputFiles", files=[str(f) for f in files],
                  backendNodeId=opened["params"]["backendNodeId"])

    def drop_files(self, files: list[Path], x: float, y: float) -> None:
        """Drags `files` from outside the browser and drops them at (x, y) (CSS px in the viewport)."""
        data = {"items": [], "files": [str(f) for f in files], "dragOperationsMask": 1}
        for kind in ("dragEnter", "dragOver", "drop"):
            self.call("Input.dispatchDragEvent", type=kind, x=x, y=y, data=data)

    def allow_downloads(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.call("Browser.setDownloadBehavior", behavior="allow", downloadPath=str(folder), eventsEnabled=True)

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

    def stop_live(self, settle_s: float = 1.5) -> None:
        """Press the live view's Stop, wait until the page says it stopped, then let it run `settle_s`
        (the websocket's close and the last messages arrive)."""
        self.evaluate("document.getElementById('stop').click()", user_gesture=True)
        assert self.wait_for("window.demoState.status === 'stopped'", 10), self.evaluate("window.demoState")
        self.pump(settle_s)

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

    def screenshot(self, path: Path, full_page: bool = False) -> None:
        """A PNG of the viewport, or of the whole page (`full_page`)."""
        params = {}
        if full_page:
            size = self.call("Page.getLayoutMetrics")["cssContentSize"]
            params = dict(captureBeyondViewport=True,
                          clip=dict(x=0, y=0, width=size["width"], height=size["height"], scale=1))
        data = self.call("Page.captureScreenshot", format="png", **params)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the browser's own process group, started above
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        shutil.rmtree(self.profile, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Full-band audio and the upper band of the page's spectrograms (the Band switch's tests)

GOLDEN_NOISY = Path(__file__).resolve().parents[1] / "fixtures" / "golden" / "noisy.flac"  # p287, 16 kHz, 4 s


def fullband_wav(path: Path, rate: int = 48000, upper: tuple[float, float] = (9000.0, 15000.0),
                 upper_to_low: float = 0.5, seed: int = 0) -> Path:
    """The golden noisy speech (nothing above 8 kHz) at `rate`, plus band-limited noise in `upper`
    (Hz) that follows the speech's envelope (the "air" of fricatives rides on the speech), its RMS
    `upper_to_low` times the low band's; a 16-bit mono WAV at `path`."""
    import numpy as np
    import soundfile as sf
    from scipy.signal import butter, resample_poly, sosfiltfilt

    x, sr = sf.read(GOLDEN_NOISY, dtype="float64")
    low = resample_poly(x, rate, sr)
    env = sosfiltfilt(butter(2, 30.0, fs=rate, output="sos"), np.abs(low))  # ~30 ms envelope
    env = np.maximum(env, 0.0) / max(env.max(), 1e-12)
    noise = np.random.default_rng(seed).standard_normal(len(low))
    high = sosfiltfilt(butter(8, upper, btype="bandpass", fs=rate, output="sos"), noise) * env
    high *= upper_to_low * np.sqrt(np.mean(low**2) / np.mean(high**2))
    y = low + high
    y *= 0.5 / np.abs(y).max()
    sf.write(path, y.astype(np.float32), rate, subtype="PCM_16")
    return path


def band_energy(x, rate: int, lo: float, hi: float | None = None) -> float:
    """Energy of the mono mix of `x` between `lo` and `hi` Hz (Nyquist when None)."""
    import numpy as np

    x = np.asarray(x, np.float64)
    if x.ndim > 1:
        x = x.mean(axis=1)
    spectrum = np.abs(np.fft.rfft(x)) ** 2
    f = np.fft.rfftfreq(len(x), 1.0 / rate)
    return float(spectrum[(f >= lo) & (f <= (hi if hi is not None else rate / 2))].sum())


def lit_above(page: Chromium, canvas_id: str, hz: float, nyquist: float, right: float = 1.0) -> dict:
    """How much of a spectrogram canvas' plot area is painted (brighter than near-black: more than
    about 65 dB below the top of its colour scale) above `hz` and below it, as shares of the pixels:
    {"above": ..., "below": ...}. The frequency axis runs from 0 at the bottom of the plot area to
    `nyquist` (half the audio's sample rate) at the top; a few rows at `hz` are left out. `right`:
    the share of the plot's width looked at, from its right edge (a live spectrogram's newest)."""
    return page.evaluate(f"""(() => {{
        const c = document.getElementById({canvas_id!r}), dpr = c.width / c.clientWidth, g = c.getContext('2d');
        // the plot area of spectrogram.js (AXIS_W = 40, AXIS_H = 18 CSS px), less a pixel at each edge
        const x00 = Math.ceil(40 * dpr) + 1, y0 = Math.ceil(2 * dpr) + 1;
        const full = Math.floor((c.clientWidth - 44) * dpr) - 2, h = Math.floor((c.clientHeight - 20) * dpr) - 2;
        const w = Math.max(1, Math.floor(full * {right})), x0 = x00 + full - w;
        const split = Math.round(h * (1 - {hz / nyquist}));
        const share = (y, rows) => {{
            const d = g.getImageData(x0, y0 + y, w, rows).data;
            let n = 0;
            for (let i = 0; i < d.length; i += 4) if (d[i] + d[i + 1] + d[i + 2] > 90) n++;
            return n / (d.length / 4);
        }};
        return {{above: share(0, split - 2), below: share(split + 2, h - split - 2)}};
    }})()""")
