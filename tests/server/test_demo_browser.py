"""The browser demo in real headless Chromium with a fake microphone playing a noisy file."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tests.conftest import speechlike

from .browser import Chromium, chromium_path

ARTIFACTS = Path(os.environ.get("TIM_ARTIFACTS", Path(__file__).resolve().parents[2] / "artifacts"))


@pytest.fixture(scope="module")
def browser_available():
    if chromium_path() is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (make test installs Debian's chromium when run as root)")
        pytest.skip("chromium is not installed: apt-get install chromium")


STREAMING = ("window.demoState.status === 'streaming' && window.demoState.enhancedSamples > {n} "
             "&& window.demoState.plottedFrames > 150 && window.demoState")


def test_demo_start_stream_stop_start_again_without_a_page_error(live, browser_available, tmp_path):
    """start -> stream -> stop (the enhanced tail still arrives) -> start again -> stop: the page
    streams each time, and not one uncaught error, console error or failed load (favicon) occurs."""
    noisy = speechlike(48000 * 4, 48000, seed=21)
    noisy = noisy + 0.05 * np.random.default_rng(0).standard_normal(noisy.shape).astype(np.float32)
    wav = tmp_path / "noisy.wav"
    sf.write(wav, noisy, 48000, subtype="PCM_16")
    frames_before = live.metrics.frames.labels(source="stream")._value.get()

    page = Chromium(live.base + "/", wav)
    try:
        assert page.wait_for("document.readyState === 'complete' && !!window.demoState", 20)
        page.evaluate("document.getElementById('start').click()", user_gesture=True)
        state = page.wait_for(STREAMING.format(n=48000), 40) or page.evaluate("window.demoState")
        page.evaluate("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")  # plot repainted
        page.screenshot(ARTIFACTS / "demo-browser.png")
        assert state["status"] == "streaming", state
        assert state["error"] is None, state
        assert state["enhancedMessages"] > 10 and state["enhancedSamples"] > 24000, state
        assert state["metadataFrames"] > 60 and state["plottedFrames"] > 60, state
        assert state["latencyMs"] == 64.0
        # the plot really shows the competition: coloured cells in the layer rows of the canvas
        coloured = page.evaluate("""(() => {
            const c = document.getElementById('plot'), g = c.getContext('2d');
            const d = g.getImageData(80, 20, c.width - 90, c.height - 80).data;
            let n = 0;
            for (let i = 0; i < d.length; i += 4) if (d[i + 3] > 0 && Math.abs(d[i] - d[i + 2]) > 40) n++;
            return n / (d.length / 4);
        })()""")
        assert coloured > 0.1, f"only {coloured:.1%} of the plot area is coloured"
        page.evaluate("document.querySelector('input[value=original]').click()", user_gesture=True)
        assert page.evaluate("window.demoState.mode") == "original"

        page.evaluate("document.getElementById('stop').click()", user_gesture=True)
        assert page.wait_for("window.demoState.status === 'stopped'", 10), page.evaluate("window.demoState")
        page.pump(2.0)  # the server sends the enhanced tail and closes after the stop
        live.wait_idle()
        first = page.evaluate("window.demoState.enhancedSamples")

        page.evaluate("document.getElementById('start').click()", user_gesture=True)
        again = page.wait_for(STREAMING.format(n=first + 48000), 40) or page.evaluate("window.demoState")
        assert again["status"] == "streaming" and again["error"] is None, again
        page.evaluate("document.getElementById('stop').click()", user_gesture=True)
        assert page.wait_for("window.demoState.status === 'stopped'", 10)
        page.pump(2.0)
        assert page.evaluate("document.getElementById('start').disabled") is False
        assert page.errors() == []
    finally:
        page.close()
    assert live.metrics.frames.labels(source="stream")._value.get() - frames_before > 120
    live.wait_idle()
