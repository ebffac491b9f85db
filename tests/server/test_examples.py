"""The examples to listen to (server/static/examples/, tools/examples.py): small 16 kHz Opus pairs
with their sources and licences, served and listed on the page's Examples tab, and made again the
same by the script with the shipped model."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tests.tolerance import snr_db

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "server" / "static" / "examples"


def listed() -> list[dict]:
    return json.loads((EXAMPLES / "examples.json").read_text())


def test_the_examples_are_small_16_khz_opus_pairs_with_their_licences():
    examples = listed()
    assert [e["name"] for e in examples] == ["noise", "music", "babble", "real"]
    total = 0
    for e in examples:
        before, _ = sf.read(EXAMPLES / e["before"])
        after, _ = sf.read(EXAMPLES / e["after"])
        for f in (e["before"], e["after"]):
            info = sf.info(EXAMPLES / f)
            assert (info.format, info.subtype, info.samplerate, info.channels) == ("OGG", "OPUS", 16000, 1), f
            total += (EXAMPLES / f).stat().st_size
        assert len(before) == len(after) and abs(len(before) / 16000 - e["seconds"]) < 0.01 and 3 <= e["seconds"] <= 10
        assert snr_db(before, after) < 10  # the after is enhanced, not the same recording
    assert total < 400_000, total
    text = (EXAMPLES / "README.md").read_text()
    for needed in ("LibriSpeech", "Voicebank+DEMAND", "CC-BY-4.0", "CC0", "python -m tools.examples"):
        assert needed in text, needed
    assert all(f"]({e['before']})" in text and f"]({e['after']})" in text for e in examples)
    assert "server/static/examples/README.md" in (ROOT / "README.md").read_text()


def test_the_examples_are_served(http):
    e = listed()[0]
    r = http.get(f"/static/examples/{e['before']}")
    assert r.status_code == 200 and r.headers["content-type"] == "audio/ogg"
    assert r.content == (EXAMPLES / e["before"]).read_bytes()
    assert http.get("/static/examples/examples.json").json() == listed()
    assert http.get("/static/examples/nope.ogg").status_code == 404
    assert http.get("/static/examples/..%2fclient.js").status_code == 404


def test_the_script_makes_them_again(tmp_path):
    """tools/examples.py with the shipped model gives the committed audio (the Ogg stream's serial
    number differs from run to run; the decoded samples do not)."""
    from tools.examples import CROWD, REAL, VOICE, main
    from training.defaults import SHARED_DATA

    if not all((SHARED_DATA / rel).is_file() for rel in (VOICE, *CROWD, REAL)):
        pytest.skip(f"the shared data ({SHARED_DATA}) is not beside this checkout")
    assert main(["--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "examples.json").read_text()) == listed()
    assert (tmp_path / "README.md").read_text() == (EXAMPLES / "README.md").read_text()
    for e in listed():
        for f in (e["before"], e["after"]):
            again, _ = sf.read(tmp_path / f)
            committed, _ = sf.read(EXAMPLES / f)
            # the same samples; another CPU's float rounding in the model may move the encoder a little
            assert np.array_equal(again, committed) or snr_db(committed, again) > 30, f


def test_the_examples_tab_plays_them(live, browser_available):
    from .browser import Chromium

    page = Chromium(live.base + "/#examples")
    try:
        assert page.wait_for("window.examplesState && window.examplesState.status === 'ready'", 20), \
            page.evaluate("window.examplesState")
        assert page.evaluate("document.getElementById('view-examples').hidden") is False
        n = len(listed())
        durations = page.wait_for(f"""(() => {{ const a = [...document.querySelectorAll('#examples audio')];
            return a.length === {2 * n} && a.every((x) => x.duration > 0) && a.map((x) => x.duration); }})()""", 20)
        assert durations and all(abs(d - e["seconds"]) < 0.1 for d, e in zip(durations[::2], listed())), durations
        assert page.errors() == []
    finally:
        page.close()
