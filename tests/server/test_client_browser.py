"""The browser module (/client.js) in real headless Chromium with a fake microphone playing a real
noisy recording: the README's example as written, from a page of another origin; the enhanced
MediaStream carries audio and the speech activity comes as events; a restart of the service (1012)
is continued from the state it hands over, as if uninterrupted, and without a state (one the
service could not take) resumed with the overlap, no sample lost or repeated; a full service (1013)
is waited out; a refusal is an error with the service's kind."""
from __future__ import annotations

import base64
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from websockets.sync.client import connect

from tests.tolerance import assert_close_to_peak

from .browser import Chromium
from .conftest import TEST_LIMITS, LiveServer
from .test_client import _best_lag, _serve_on

ROOT = Path(__file__).resolve().parents[2]
NOISY = ROOT / "tests" / "fixtures" / "golden" / "noisy.flac"  # real noisy speech (p287), 16 kHz, 4 s


@pytest.fixture
def mic_file(tmp_path) -> Path:
    x, sr = sf.read(NOISY, dtype="int16")
    path = tmp_path / "noisy.wav"
    sf.write(path, x, sr, subtype="PCM_16")
    return path


def readme_example() -> str:
    """The README's browser example (its one html block)."""
    blocks = re.findall(r"^```html\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)
    assert len(blocks) == 1
    return blocks[0]


def run_html(page: Chromium, html: str) -> None:
    """Put `html` in the page: its elements, and its module scripts run as written."""
    scripts = re.findall(r"<script type=\"module\">\n(.*?)</script>", html, flags=re.S)
    markup = re.sub(r"<script type=\"module\">.*?</script>", "", html, flags=re.S)
    page.evaluate(f"document.body.innerHTML = {json.dumps(markup)}")
    for code in scripts:
        page.evaluate(f"""(() => {{ const s = document.createElement('script'); s.type = 'module';
            s.textContent = {json.dumps(code)}; document.head.appendChild(s); }})()""")


def unexpected_errors(page: Chromium) -> list[str]:
    """The page's errors but the browser's own log lines that are expected here: the JSON page has no
    icon, and a websocket refused while nothing listens (a restart), or reset when it reached the
    listening socket of a service closing it (the kernel resets what was not accepted yet), is
    logged by the browser."""
    return [e for e in page.errors() if "favicon.ico" not in e
            and not ("/v1/stream' failed" in e and ("ERR_CONNECTION_REFUSED" in e or "ERR_CONNECTION_RESET" in e))]


def console_lines(page: Chromium, prefix: str) -> list[list]:
    """The arguments of every console.log call whose first argument is `prefix`."""
    out = []
    for e in page.events:
        if e["method"] == "Runtime.consoleAPICalled" and e["params"].get("type") == "log":
            args = [a.get("value") for a in e["params"].get("args", [])]
            if args and args[0] == prefix:
                out.append(args[1:])
    return out


def test_the_readme_example_runs_from_a_page_of_another_origin(live, browser_available, mic_file):
    """The example as written (its address pointed at the test's service), in a page of another
    origin (localhost against 127.0.0.1): the module is imported across origins, the microphone is
    enhanced, the speech activity is logged per 16 ms hop, between 0 and 1, high in speech."""
    html = readme_example().replace("http://127.0.0.1:8000", live.base)
    assert len(html.strip().splitlines()) <= 14
    frames_before = live.metrics.frames.labels(source="stream")._value.get()
    page = Chromium(f"http://localhost:{live.port}/healthz", mic_file)
    try:
        assert page.wait_for("document.readyState === 'complete'", 20)
        run_html(page, html)
        assert page.wait_for("!!document.querySelector('button').onclick", 20)  # the module has run
        page.evaluate("document.querySelector('button').click()", user_gesture=True)
        deadline = time.time() + 40
        while len(console_lines(page, "speech")) < 100 and time.time() < deadline:
            page.pump(0.5)
        values = [args[0] for args in console_lines(page, "speech")]
        assert len(values) >= 100, (values[:5], page.errors())
        assert all(0.0 <= v <= 1.0 for v in values) and max(values) > 0.3, values[:20]
        assert unexpected_errors(page) == []
    finally:
        page.close()
    assert live.metrics.frames.labels(source="stream")._value.get() - frames_before > 100
    live.wait_idle()


OPEN = """(async () => {{
    const {{ EnhancedStream }} = await import('{base}/client.js');
    const mic = await navigator.mediaDevices.getUserMedia({{ audio: true }});
    const t = window.t = {{ states: [], activity: 0, outPeak: 0, error: null, inputs: [], outputs: [], readies: [],
                           handoffs: [], restart: null }};
    const s = t.s = new EnhancedStream(mic, {options});
    s.addEventListener('state', (e) => {{
        t.states.push(e.detail.state);
        // the first close that is resumed: its code, and the output received by then
        if (e.detail.state === 'reconnecting' && e.detail.code !== null && !t.restart) t.restart = {{ code: e.detail.code, samplesOut: s.samplesOut }};
    }});
    s.addEventListener('activity', (e) => {{ t.activity += e.detail.frames.length; }});
    // every sample sent and received, in order, and the messages of a resume
    s.addEventListener('input', (e) => t.inputs.push(e.detail.samples.slice()));
    s.addEventListener('audio', (e) => t.outputs.push(e.detail.samples.slice()));
    s.addEventListener('ready', (e) => t.readies.push(e.detail));
    s.addEventListener('handoff', (e) => t.handoffs.push(e.detail));
    s.start().then(() => {{
        t.started = true;
        // what plays from the enhanced MediaStream, read back by a second AudioContext
        const ctx = new AudioContext(), an = ctx.createAnalyser();
        ctx.createMediaStreamSource(s.output).connect(an);
        const buf = new Float32Array(an.fftSize);
        setInterval(() => {{ an.getFloatTimeDomainData(buf); for (const v of buf) t.outPeak = Math.max(t.outPeak, Math.abs(v)); }}, 40);
    }}, (e) => {{ t.error = {{ kind: e.kind, message: e.message, code: e.code }}; }});
    return true;
}})()"""


def open_stream(page: Chromium, base: str, **options) -> None:
    """An EnhancedStream of the fake microphone in `window.t.s`, its states in `window.t.states`."""
    assert page.evaluate(OPEN.format(base=base, options=json.dumps(options)), user_gesture=True)


def stop(page: Chromium) -> dict:
    """Stop the stream: what its end resolves with, and its counts."""
    return page.evaluate("window.t.s.stop().then((r) => ({...r, samplesIn: window.t.s.samplesIn, "
                         "sessions: window.t.s.sessions, state: window.t.s.state}))")


PCM = """(() => {{
    const parts = window.t.{which};
    const all = new Float32Array(parts.reduce((n, p) => n + p.length, 0));
    let at = 0;
    for (const p of parts) {{ all.set(p, at); at += p.length; }}
    const b = new Uint8Array(all.buffer);
    let text = '';
    for (let i = 0; i < b.length; i += 0x8000) text += String.fromCharCode.apply(null, b.subarray(i, i + 0x8000));
    return btoa(text);
}})()"""


def recorded(page: Chromium, which: str) -> np.ndarray:
    """Every sample the stream sent ("inputs") or received ("outputs"), in order."""
    return np.frombuffer(base64.b64decode(page.evaluate(PCM.format(which=which))), "<f4")


@pytest.mark.parametrize("case", ["state", "overlap", "refused"])
def test_the_module_streams_survives_a_restart_and_loses_nothing(model_path, enhancer_rt, browser_available, mic_file,
                                                                 case):
    """openStream(microphone): the enhanced MediaStream carries audio, activity events come; the
    service drains (1012) and comes back on the same port: the module reconnects and, stopped, has
    received exactly as many enhanced samples as it sent. With the state the service hands over
    ("state" message), the second connection continues the stream ("resumed") and the whole output
    equals the uninterrupted enhancement of all that was sent; without it (a first service whose
    max_state_bytes is too small for it: the tail instead), the module resends from resumeOverlapS
    before the missing output, and the output goes on at lag 0: nothing lost, nothing repeated. A
    state the next service refuses (its max_state_bytes is too small: invalid_state) is dropped and
    the module resumes with the overlap as well."""
    handoff = case == "state"
    small = dict(max_state_bytes=1024)
    first = LiveServer(model=model_path, **(TEST_LIMITS | dict(drain_timeout_s=0.3) | (small if case == "overlap" else {})))
    second = None
    page = Chromium(first.base + "/healthz", mic_file)
    try:
        assert page.wait_for("document.readyState === 'complete'", 20)
        open_stream(page, first.base, metadata=True)
        assert page.wait_for("window.t.started && window.t.s.samplesOut > 2 * window.t.s.sampleRate", 40), \
            page.evaluate("window.t")
        t = page.evaluate("({activity: t.activity, outPeak: t.outPeak, state: t.s.state, rate: t.s.sampleRate})")
        assert t["state"] == "streaming" and t["activity"] > 60 and t["outPeak"] > 0.005, t
        first.stop()  # drains: the tail, end "shutdown", close 1012; nothing listens for a while
        time.sleep(0.5)
        second = _serve_on(first.port, model_path, **(small if case == "refused" else {}))
        assert page.wait_for("window.t.s.sessions === 2 && window.t.s.state === 'streaming' && "
                             "window.t.s.samplesOut > window.t.s.samplesIn - window.t.s.sampleRate", 40), \
            page.evaluate("({states: t.states, state: t.s.state, sessions: t.s.sessions})")
        states = page.evaluate("window.t.states")
        assert states.index("reconnecting") < len(states) - 1 - states[::-1].index("streaming"), states
        done = stop(page)
        assert done["complete"] is True and done["samples"] == done["samplesIn"] > 3 * t["rate"], done
        assert done["state"] == "ended" and done["sessions"] == 2, done
        r = page.evaluate("({readies: t.readies, handoffs: t.handoffs, restart: t.restart, "
                          "resumed: t.s.resumed})")
        x, y = recorded(page, "inputs"), recorded(page, "outputs")
        assert unexpected_errors(page) == []
    finally:
        page.close()
        first.stop()
        if second is not None:
            second[0].should_exit = True
            second[1].join(timeout=15)
    rate, n = t["rate"], r["restart"]["samplesOut"]  # n: the output received when the first service closed
    assert len(x) == len(y) == done["samplesIn"] and 0 < n < len(x), (len(x), len(y), done, n)
    # (the drain waits for the closing handshake: a client still sending is never reset, so the state,
    # the end and the close frame all arrive)
    assert r["restart"]["code"] == 1012, r["restart"]
    first_ready, second_ready = r["readies"]
    assert first_ready["resumable"] is True and "resumed" not in first_ready, first_ready
    whole = enhancer_rt.enhance(x, rate)
    if handoff:
        (h,) = r["handoffs"]  # the service's "state" message, in absolute samples
        assert h["kept"] is True and h["bytes"] > 1024 and h["output_samples"] == n < h["input_samples"] <= len(x), h
        assert second_ready["resumed"] == {"input_samples": h["input_samples"], "output_samples": n}, second_ready
        assert r["resumed"] == 1
        # (the offline run groups hops into calls of many frames, the live one steps them one by one)
        assert_close_to_peak(y, whole, rel=3e-4)
    elif case == "refused":
        (h,) = r["handoffs"]
        assert h["kept"] is True and r["resumed"] == 0 and "resumed" not in second_ready, r
        # before the restart: the uninterrupted run's (the first service stopped at a whole hop, no tail);
        # after it: a new stream's from 1 s (resumeOverlapS) before, its overlap dropped, at lag 0
        assert_close_to_peak(y[:n], whole[:n], rel=3e-4)
        begin = max(0, n - rate)
        assert_close_to_peak(y[n:], enhancer_rt.enhance(x[begin:], rate)[n - begin:])
        assert _best_lag(y[n:], whole[n:]) == 0
    else:
        assert r["handoffs"] == [] and r["resumed"] == 0 and "resumed" not in second_ready, r
        # before the restart: the first stream's output, its tail included: the enhancement of all it
        # read; the uninterrupted run's but for the end, enhanced without the lookahead that came
        # after the drain (the model's, and the reach of the resamplers' filters to and from the
        # model's rate: 50 ms more at most)
        assert_close_to_peak(y[:n], enhancer_rt.enhance(x[:n], rate))
        reach = second_ready["delay_samples"] + rate // 20
        assert_close_to_peak(y[:n - reach], whole[:n - reach], rel=3e-4)
        # after it: a new stream's from 1 s (resumeOverlapS) before, its overlap dropped, at lag 0
        # against the uninterrupted run
        begin = max(0, n - rate)
        assert_close_to_peak(y[n:], enhancer_rt.enhance(x[begin:], rate)[n - begin:])
        assert _best_lag(y[n:], whole[n:]) == 0


def test_a_full_service_is_waited_out_and_a_refusal_has_its_kind(model_path, browser_available, mic_file):
    srv = LiveServer(model=model_path, **(TEST_LIMITS | dict(max_streams=1, capacity=1)))
    page = Chromium(srv.base + "/healthz", mic_file)
    try:
        assert page.wait_for("document.readyState === 'complete'", 20)
        open_stream(page, srv.base, band="wide")
        assert page.wait_for("window.t.error", 20) == {"kind": "invalid_parameter", "code": 1007,
                                                       "message": 'band must be "full" or "speech", got \'wide\''}
        with connect(srv.ws_url) as blocker:  # holds the only place
            blocker.send(json.dumps({"sample_rate": 16000}))
            assert json.loads(blocker.recv(timeout=10))["type"] == "ready"
            open_stream(page, srv.base, maxWaitS=0.5, maxRetries=100)
            assert page.wait_for("window.t.states.includes('waiting')", 10), page.evaluate("window.t.states")
            page.pump(1.5)
            assert page.evaluate("[window.t.started, window.t.error, window.t.s.state]") == [None, None, "waiting"]
        assert page.wait_for("window.t.started && window.t.s.samplesOut > window.t.s.sampleRate", 40), \
            page.evaluate("window.t.states")
        assert page.evaluate("window.t.states").count("streaming") == 1
        done = stop(page)
        assert done["complete"] is True and done["sessions"] == 1, done
        assert unexpected_errors(page) == []
    finally:
        page.close()
        srv.stop()
