"""The page's live microphone view in real headless Chromium with a fake microphone playing a real
noisy recording (tests/fixtures/golden/noisy.flac, p287, 16 kHz)."""
from __future__ import annotations

import io
import math
import os
from pathlib import Path

import pytest
import soundfile as sf

from enhancer.runtime import default_model_path

from .browser import ARTIFACTS, Chromium, fullband_wav, lit_above
from .conftest import TEST_LIMITS, LiveServer

NOISY = Path(__file__).resolve().parents[1] / "fixtures" / "golden" / "noisy.flac"
STREAMING = ("window.demoState.status === 'streaming' && window.demoState.enhancedSamples > {n} "
             "&& window.demoState.plottedFrames > 150 && window.demoState.roundTripMs !== null && window.demoState")


def lit(page: Chromium, canvas_id: str) -> float:
    """Share of a canvas' pixels that are painted brighter than near-black."""
    return page.evaluate(f"""(() => {{
        const c = document.getElementById({canvas_id!r}), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < d.length; i += 4) if (d[i + 3] > 0 && d[i] + d[i + 1] + d[i + 2] > 90) n++;
        return n / (d.length / 4);
    }})()""")


def test_live_view_by_keyboard_stream_spectrograms_meters_latency_stop_start_again(live, browser_available, tmp_path, capsys):
    """Keyboard only: Tab to Start, Enter -> the microphone streams; the input and output
    spectrograms scroll, the level meters move, the end-to-end latency is measured, the competition
    plot is drawn and the raw state sits behind a closed "Details" disclosure; Enter on Stop stops
    it (the enhanced tail still arrives), it starts again and stops again, and not one uncaught
    error, console error or failed load (favicon) occurs."""
    x, sr = sf.read(NOISY, dtype="int16")
    wav = tmp_path / "noisy.wav"
    sf.write(wav, x, sr, subtype="PCM_16")
    frames_before = live.metrics.frames.labels(source="stream")._value.get()

    page = Chromium(live.base + "/#live", wav)
    try:
        assert page.wait_for("document.readyState === 'complete' && !!window.demoState", 20)
        assert page.evaluate("[document.body.dataset.view, document.getElementById('view-file').hidden]") == ["live", True]
        page.tab_to("el.id === 'start'")
        page.press("Enter")
        rate = page.wait_for("window.demoState.sampleRate", 20)
        state = page.wait_for(STREAMING.format(n=rate), 40) or page.evaluate("window.demoState")
        page.pump(0.5)
        state = page.evaluate("window.demoState")
        assert state["status"] == "streaming", state
        assert state["error"] is None, state
        assert state["enhancedMessages"] > 10 and state["enhancedSamples"] > rate // 2, state
        assert state["metadataFrames"] > 60 and state["plottedFrames"] > 60, state
        # the model's 64 ms, and at another rate than 16 kHz 2 x 6.7 ms of resampling (44.1 kHz here, as a rule)
        assert state["latencyMs"] == pytest.approx({16000: 64.0, 44100: 64 + 6.6875 + 295 / 44.1, 48000: 77.375}[rate])
        # the latency, measured: output sample i against the moment input sample i was captured
        assert state["latencyMs"] <= state["roundTripMs"] < 3000, state
        assert state["endToEndMs"] >= state["roundTripMs"] + state["playbackBufferMs"], state
        shown = page.evaluate("[document.getElementById('latency').textContent, window.demoState.endToEndMs]")
        assert shown[0] == f"{shown[1]} ms", shown
        # level meters: speech in, speech out
        assert -50 < state["inputLevelDb"] < 0 and -80 < state["outputLevelDb"] < 0, state
        assert page.evaluate("document.getElementById('level-in').value") > -50
        # both live spectrograms scroll (one column per half FFT) and are painted
        cols = state["spectrogramColumns"]
        assert cols["input"] > 50 and cols["output"] > 50, cols
        for cid in ("live-in", "live-out"):
            assert lit(page, cid) > 0.1, cid
        # the plot really shows the competition: coloured cells in the layer rows of the canvas
        coloured = page.evaluate("""(() => {
            const c = document.getElementById('plot'), g = c.getContext('2d');
            const d = g.getImageData(80, 20, c.width - 90, c.height - 80).data;
            let n = 0;
            for (let i = 0; i < d.length; i += 4) if (d[i + 3] > 0 && Math.abs(d[i] - d[i + 2]) > 40) n++;
            return n / (d.length / 4);
        })()""")
        assert coloured > 0.1, f"only {coloured:.1%} of the plot area is coloured"
        path = ARTIFACTS / "demo" / "live-view.png"
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(path, full_page=True)
        with capsys.disabled():
            print(f"\n  screenshot: {path}")
        # the raw state is behind "Details", closed; Enter on its summary opens it
        assert page.evaluate("[document.getElementById('details').open, document.getElementById('results').checkVisibility()]") == [False, False]
        assert '"chunksSent"' in page.evaluate("document.getElementById('results').textContent")
        page.tab_to("el.tagName === 'SUMMARY'")
        page.press("Enter")
        assert page.evaluate("document.getElementById('results').checkVisibility()") is True
        page.evaluate("document.querySelector('input[name=mode][value=original]').click()", user_gesture=True)
        assert page.evaluate("window.demoState.mode") == "original"

        page.tab_to("el.id === 'stop'", shift=True)
        page.press("Enter")
        assert page.wait_for("window.demoState.status === 'stopped'", 10), page.evaluate("window.demoState")
        page.pump(2.0)  # the server sends the enhanced tail and closes after the stop
        live.wait_idle()
        first = page.evaluate("window.demoState.enhancedSamples")

        page.evaluate("document.getElementById('start').click()", user_gesture=True)
        again = page.wait_for(STREAMING.format(n=first + rate), 40) or page.evaluate("window.demoState")
        assert again["status"] == "streaming" and again["error"] is None, again
        page.stop_live(2.0)
        assert page.evaluate("document.getElementById('start').disabled") is False
        assert page.errors() == []
    finally:
        page.close()
    assert live.metrics.frames.labels(source="stream")._value.get() - frames_before > 120
    live.wait_idle()


NEWEST = 0.2  # the share of a live spectrogram looked at: its last second of 5, streamed in each run


def stream_until(page: Chromium, columns: int, timeout: float = 40) -> dict:
    """Start the microphone, wait until the output spectrogram has `columns` columns, stop."""
    page.evaluate("document.getElementById('start').click()", user_gesture=True)
    state = page.wait_for(f"window.demoState.status === 'streaming' && window.demoState.spectrogramColumns.output > {columns} "
                          "&& window.demoState", timeout) or page.evaluate("window.demoState")
    assert state["status"] == "streaming" and state["error"] is None, state
    return state


def test_live_view_band_switch_full_band_from_a_48_khz_microphone(live, browser_available, tmp_path, capsys):
    """The fake microphone plays a 48 kHz recording with energy above 8 kHz (the golden noisy speech
    plus band-limited noise at 9-15 kHz following its envelope); the page's AudioContext runs at
    its own rate (44.1 or 48 kHz), above 16 kHz either way. Band "full" (the default): the server
    confirms it and the output spectrogram's rows above 9 kHz are painted like the input's; Stop,
    band "speech", Start: the output has nothing above 9 kHz while the input still has. An
    attenuation limit of 6 dB floors the upper band's gain at 0.5: the test server's random-weight
    model closes it whenever it likes."""
    wav = fullband_wav(tmp_path / "fullband.wav")
    page = Chromium(live.base + "/#live", wav)
    try:
        assert page.wait_for("document.readyState === 'complete' && !!window.demoState", 20)
        assert page.evaluate("document.getElementById('band').value") == "full"
        page.evaluate("document.getElementById('atten').value = '6'")
        state = stream_until(page, 150)
        rate = state["sampleRate"]
        assert rate > 32000 and (state["band"], state["atten"]) == ("full", 6), state
        full_in = lit_above(page, "live-in", 9000, rate / 2, NEWEST)
        full_out = lit_above(page, "live-out", 9000, rate / 2, NEWEST)
        assert full_in["above"] > 0.3, full_in  # the microphone's upper band reaches the page
        assert full_out["above"] > 0.5 * full_in["above"], (full_out, full_in)
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(ARTIFACTS / "demo" / "live-view-full-band.png", full_page=True)
        page.stop_live(1.5)
        live.wait_idle()

        page.evaluate("document.getElementById('band').value = 'speech'")
        state = stream_until(page, 150)
        assert (state["band"], state["atten"]) == ("speech", 6), state
        assert "speech band" in page.evaluate("document.getElementById('info').textContent")
        speech_in = lit_above(page, "live-in", 9000, rate / 2, NEWEST)
        speech_out = lit_above(page, "live-out", 9000, rate / 2, NEWEST)
        assert speech_in["above"] > 0.3, speech_in
        assert speech_out["above"] < 0.05 * speech_in["above"], (speech_out, speech_in)
        assert speech_out["below"] > 0.5 * full_out["below"], (speech_out, full_out)  # the speech band stays
        path = ARTIFACTS / "demo" / "live-view-speech-band.png"
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(path, full_page=True)
        with capsys.disabled():
            print(f"\n  screenshots: {path.parent}/live-view-{{full,speech}}-band.png")
        page.stop_live(1.5)
        assert page.errors() == []
    finally:
        page.close()
    live.wait_idle()


# ---------------------------------------------------------------------------------------------
# The README's screenshot

README_SHOT = Path(__file__).resolve().parents[2] / "docs" / "demo.png"


@pytest.fixture(scope="module")
def live_shipped():
    """A real server on the shipped model (models/tim.onnx, trained weights), for this module."""
    path = default_model_path()
    if not path.is_file():
        pytest.skip(f"no shipped model at {path}")
    srv = LiveServer(model=path, **TEST_LIMITS)
    yield srv
    srv.stop()


def small_png(png: bytes, max_width: int = 1100) -> bytes:
    """The screenshot at most `max_width` px wide, as an optimised PNG of 256 colours (a third of
    the lossless size; every device call carries the checkout)."""
    from PIL import Image

    im = Image.open(io.BytesIO(png)).convert("RGB")
    if im.width > max_width:
        im = im.resize((max_width, round(im.height * max_width / im.width)), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    im.quantize(256, method=Image.Quantize.MEDIANCUT).save(out, "PNG", optimize=True)
    return out.getvalue()


def live_window_columns(rate: int, seconds: float = 5.0) -> int:
    """Columns of a live spectrogram's window at `rate` (spectrogram.js: an FFT of about 30 ms, a
    hop of half of it)."""
    n = 2 ** max(7, min(13, round(math.log2(rate * 0.03))))
    return math.ceil(seconds * rate / (n // 2))


def test_readme_screenshot_of_the_live_view_with_the_shipped_model(live_shipped, browser_available, tmp_path, capsys):
    """The screenshot in the README: the live view streaming the golden noisy recording through the
    shipped model for a whole spectrogram window (5 s), both spectrograms (noisy input, enhanced
    output), meters, measured latency and the competition plot visible.

    It is written to artifacts/demo/readme.png on every run; to docs/demo.png (committed, shown by
    README.md) only with TIM_UPDATE_SCREENSHOT=1, so that running the tests leaves the checkout
    clean:  TIM_UPDATE_SCREENSHOT=1 pytest tests/server/test_demo_browser.py -k readme"""
    x, sr = sf.read(NOISY, dtype="int16")
    wav = tmp_path / "noisy.wav"
    sf.write(wav, x, sr, subtype="PCM_16")
    page = Chromium(live_shipped.base + "/#live", wav, width=1100, height=820)
    try:
        assert page.wait_for("document.readyState === 'complete' && !!window.demoState", 20)
        page.evaluate("document.getElementById('start').click()", user_gesture=True)
        rate = page.wait_for("window.demoState.sampleRate", 20)
        # a whole window of enhanced audio: the output spectrogram has scrolled all the way across
        full = ("(s => s.status === 'streaming' && s.roundTripMs !== null && s.plottedFrames >= 240 "
                f"&& s.spectrogramColumns.output > {live_window_columns(rate) + 10} && s)(window.demoState)")
        state = page.wait_for(full, 40) or page.evaluate("window.demoState")
        assert state["status"] == "streaming" and state["error"] is None, state
        # both spectrograms are drawn across the window; the shipped model removes noise, so less
        # of the enhanced one is lit (the noise floor between the words is gone)
        noisy, enhanced = (lit_above(page, cid, 8000, rate / 2) for cid in ("live-in", "live-out"))
        assert noisy["below"] > 0.5 and 0.3 < enhanced["below"] < noisy["below"], (noisy, enhanced)
        page.evaluate("document.activeElement.blur(); window.scrollTo(0, 0)")
        raw = tmp_path / "raw.png"
        page.screenshot(raw, full_page=True)
        png = small_png(raw.read_bytes())
        out = ARTIFACTS / "demo" / "readme.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(png)
        targets = [out]
        if os.environ.get("TIM_UPDATE_SCREENSHOT") == "1":
            README_SHOT.write_bytes(png)
            targets.append(README_SHOT)
        with capsys.disabled():
            print(f"\n  screenshot ({len(png) // 1024} KB): {', '.join(map(str, targets))}")
        page.stop_live(1.5)
        assert page.errors() == []
    finally:
        page.close()
    live_shipped.wait_idle()
