"""The web page's file view (drop or choose a recording, A/B player, spectrograms, download), its
errors in words, a phone-sized window and an API key, in real headless Chromium.

Each test collects every uncaught page error, console error and failed load, and asserts there are
none (in the error flows: none but the browser's own log line for each refused upload). Screenshots
go to artifacts/demo/ (not committed)."""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

from .browser import ARTIFACTS, Chromium, band_energy, fullband_wav, lit_above

NOISY = Path(__file__).resolve().parents[1] / "fixtures" / "golden" / "noisy.flac"  # real noisy speech, 4 s
READY = "window.fileState.status === 'ready' || window.fileState.status === 'error'"
SHOTS = ARTIFACTS / "demo"


def shot(page: Chromium, name: str, capsys) -> None:
    path = SHOTS / name
    page.screenshot(path, full_page=True)
    with capsys.disabled():
        print(f"\n  screenshot: {path}")


def noisy_wav(folder: Path) -> Path:
    """The committed noisy cut (p287, 16 kHz mono) as a 16-bit WAV, the samples unchanged."""
    x, sr = sf.read(NOISY, dtype="int16")
    path = folder / "p287_noisy.wav"
    sf.write(path, x, sr, subtype="PCM_16")
    return path


def rest(base: str, path: Path, ctype: str, key: str | None = None, **params) -> bytes:
    headers = {"Content-Type": ctype} | ({"X-API-Key": key} if key else {})
    r = httpx.post(f"{base}/v1/enhance", content=path.read_bytes(), headers=headers, params=params, timeout=60)
    assert r.status_code == 200, r.text
    return r.content


def drawn(page: Chromium, canvas_id: str) -> dict:
    """How much of a canvas is painted: share of lit pixels and number of distinct colours."""
    return page.evaluate(f"""(() => {{
        const c = document.getElementById({canvas_id!r}), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let lit = 0; const colours = new Set();
        for (let i = 0; i < d.length; i += 4) {{
            if (d[i + 3] > 0 && d[i] + d[i + 1] + d[i + 2] > 90) lit++;
            if (colours.size < 5000) colours.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]);
        }}
        return {{lit: lit / (d.length / 4), colours: colours.size, width: c.width, height: c.height}};
    }})()""")


def download(page: Chromium, folder: Path, trigger) -> bytes:
    """Bytes of the file the browser saves when `trigger()` runs (a key press on the link)."""
    before = set(folder.glob("*"))
    since = len(page.events)
    trigger()
    states = []
    for _ in range(100):
        states = [e["params"]["state"] for e in page.events[since:] if e["method"] == "Browser.downloadProgress"]
        if "completed" in states or "canceled" in states:
            break
        page.pump(0.1)
    assert "completed" in states, f"the download did not complete: {states}"
    new = [p for p in folder.glob("*") if p not in before and not p.name.endswith(".crdownload")]
    assert len(new) == 1, new
    return new[0].read_bytes()


def test_file_view_by_keyboard_upload_ab_switch_download_and_rerun(live, browser_available, tmp_path, capsys):
    """Keyboard only: Tab to the drop zone, Enter opens the file chooser, a real noisy WAV is
    uploaded (progress seen), both spectrograms are drawn on one scale, Space plays, the arrow keys
    switch original/enhanced without moving the position, Enter on the download link saves the
    REST output byte for byte (same length, rate and channels as the input), and the attenuation
    limit re-runs the file."""
    wav = noisy_wav(tmp_path)
    info = sf.info(wav)
    downloads = tmp_path / "downloads"
    page = Chromium(live.base + "/")
    try:
        page.allow_downloads(downloads)
        assert page.wait_for("document.readyState === 'complete' && !!window.fileState "
                             "&& document.getElementById('file-limits').textContent !== ''", 20)
        assert page.evaluate("document.body.dataset.view") == "file"
        page.tab_to("el.id === 'drop'")
        focus = page.evaluate("(s => [s.outlineStyle, parseFloat(s.outlineWidth)])(getComputedStyle(document.activeElement))")
        assert focus[0] != "none" and focus[1] >= 2, f"no visible focus on the drop zone: {focus}"
        page.choose_files(lambda: page.press("Enter"), [wav])
        assert page.wait_for(READY, 60)
        state = page.evaluate("window.fileState")
        assert state["status"] == "ready", state
        assert state["statuses"][:2] == ["uploading", "enhancing"] and state["uploadProgress"] == 1, state
        assert (state["sampleRate"], state["channels"], state["frames"]) == (info.samplerate, info.channels, info.frames)
        assert state["format"] == "WAV" and state["downloadName"] == "p287_noisy-enhanced.wav", state
        assert state["decoded"] == {"original": True, "enhanced": True}, state
        assert page.evaluate("document.getElementById('file-error').hidden") is True

        # both spectrograms: drawn, same number of columns (time-aligned), not the same picture
        assert state["columns"]["original"] == state["columns"]["enhanced"] > 100, state["columns"]
        for cid in ("spec-original", "spec-enhanced", "file-scale"):
            d = drawn(page, cid)
            assert d["lit"] > 0.2 and d["colours"] > 100, (cid, d)
        differ = page.evaluate("""(() => {
            const px = id => (c => c.getContext('2d').getImageData(0, 0, c.width, c.height).data)(document.getElementById(id));
            const a = px('spec-original'), b = px('spec-enhanced'); let s = 0;
            for (let i = 0; i < a.length; i += 4) s += Math.abs(a[i] - b[i]) + Math.abs(a[i + 1] - b[i + 1]);
            return s / (a.length / 4);
        })()""")
        assert differ > 2, f"the enhanced spectrogram looks like the original ({differ:.2f})"

        # the download (Enter on the link) is the REST answer, byte for byte
        reference = rest(live.base, wav, "audio/wav")
        page.tab_to("el.id === 'download'")
        saved = download(page, downloads, lambda: page.press("Enter"))
        assert saved == reference
        out = sf.info(downloads / "p287_noisy-enhanced.wav")
        assert (out.samplerate, out.channels, out.frames, out.format) == (info.samplerate, info.channels, info.frames, "WAV")

        # A/B: Space on Play, then the arrow keys in the radio group switch what is heard
        page.tab_to("el.id === 'play'", shift=True)
        page.press(" ")
        assert page.wait_for("window.fileState.playing && window.filePlayer.position() > 0.4", 10)
        gains = ("(n => ({original: n.original.gain.gain.value, enhanced: n.enhanced.gain.gain.value}))"
                 "(window.filePlayer.nodes)")
        assert page.evaluate(gains) == {"original": 0, "enhanced": 1}
        page.tab_to("el.name === 'ab'")
        before = page.evaluate("window.filePlayer.position()")
        page.press("ArrowLeft")  # enhanced -> original
        assert page.evaluate("window.fileState.listen") == "original"
        after = page.evaluate("window.filePlayer.position()")
        assert before <= after < before + 0.5, (before, after)  # it went on from where it was
        page.pump(0.1)
        g = page.evaluate(gains)
        assert g["original"] > 0.99 and g["enhanced"] < 0.01, g
        page.tab_to("el.id === 'play'", shift=True)
        page.press("Enter")  # pause
        assert page.wait_for("!window.fileState.playing", 5)
        paused = page.evaluate("window.filePlayer.position()")
        page.evaluate("document.querySelector('input[name=ab][value=enhanced]').click()", user_gesture=True)
        assert page.evaluate("[window.fileState.listen, window.filePlayer.position()]") == ["enhanced", paused]
        assert page.evaluate("window.fileState.switches") == 2

        # the attenuation limit re-runs the same file; the new download is the REST answer for it
        page.tab_to("el.id === 'file-atten'", shift=True)
        page.press("ArrowDown")  # none -> 6 dB
        assert page.wait_for("window.fileState.runs === 2 && window.fileState.status === 'ready'", 60), \
            page.evaluate("window.fileState")
        state = page.evaluate("window.fileState")
        assert state["atten"] == 6 and state["downloadName"] == "p287_noisy-enhanced-6dB.wav", state
        assert page.evaluate("[window.fileState.listen, window.filePlayer.position()]") == ["enhanced", paused]
        page.tab_to("el.id === 'download'")
        saved6 = download(page, downloads, lambda: page.press("Enter"))
        assert saved6 == rest(live.base, wav, "audio/wav", atten_lim_db=6) and saved6 != reference
        page.evaluate("window.scrollTo(0, 0)")
        shot(page, "file-view.png", capsys)
        assert page.errors() == []
    finally:
        page.close()
    live.wait_idle()


def test_file_view_drag_and_drop_of_a_stereo_flac(live, browser_available, tmp_path):
    """A stereo FLAC dragged onto the drop zone: the enhanced file comes back as FLAC with two
    channels and the same length (equal to the REST output), and the spectrograms are drawn."""
    x, sr = sf.read(NOISY, dtype="float32")
    stereo = np.stack([x, 0.7 * np.roll(x, 160)], axis=1)
    flac = tmp_path / "interview.flac"
    sf.write(flac, stereo, sr, format="FLAC", subtype="PCM_16")
    page = Chromium(live.base + "/")
    try:
        assert page.wait_for("document.readyState === 'complete' && !!window.fileState", 20)
        box = page.evaluate("(r => [r.x + r.width / 2, r.y + r.height / 2])(document.getElementById('drop').getBoundingClientRect())")
        page.drop_files([flac], *box)
        assert page.wait_for(READY, 60)
        state = page.evaluate("window.fileState")
        assert state["status"] == "ready" and state["name"] == "interview.flac", state
        assert (state["channels"], state["frames"], state["sampleRate"], state["format"]) == (2, len(x), sr, "FLAC"), state
        assert state["columns"]["original"] == state["columns"]["enhanced"] > 100
        got = page.evaluate("""fetch(document.getElementById('download').href).then(r => r.arrayBuffer()).then(b => {
            let s = ''; const u = new Uint8Array(b);
            for (let i = 0; i < u.length; i++) s += String.fromCharCode(u[i]);
            return btoa(s);
        })""")
        body = base64.b64decode(got)
        assert body == rest(live.base, flac, "audio/flac")
        y, rate = sf.read(io.BytesIO(body))
        assert y.shape == stereo.shape and rate == sr
        assert drawn(page, "spec-enhanced")["lit"] > 0.2
        assert page.errors() == []
    finally:
        page.close()
    live.wait_idle()


def blob_bytes(page: Chromium) -> bytes:
    """The enhanced file the download link holds (the server's answer, as the page keeps it)."""
    got = page.evaluate("""fetch(document.getElementById('download').href).then(r => r.arrayBuffer()).then(b => {
        let s = ''; const u = new Uint8Array(b);
        for (let i = 0; i < u.length; i++) s += String.fromCharCode(u[i]);
        return btoa(s);
    })""")
    return base64.b64decode(got)


def test_file_view_band_switch_full_band_kept_or_cut_at_8_khz(live, browser_available, tmp_path, capsys):
    """A 48 kHz recording with energy above 8 kHz (the golden noisy speech plus band-limited noise
    at 9-15 kHz that follows its envelope). Band "full" (the default): the enhanced file keeps the
    upper band (its energy above 9 kHz is a sizeable share of the input's) and the enhanced
    spectrogram's rows above 9 kHz are painted like the original's; switching to "speech" enhances
    it again, and the enhanced file and spectrogram have nothing above 9 kHz while the band below
    8 kHz stays. An attenuation limit of 6 dB (a gain floor of 0.5) is chosen because the test
    server's random-weight model closes the upper band whenever it likes; the shipped model opens
    it with speech."""
    wav = fullband_wav(tmp_path / "fullband.wav")
    x, sr = sf.read(wav)
    upper_in, lower_in = band_energy(x, sr, 9000), band_energy(x, sr, 100, 7500)
    assert upper_in > 0.1 * lower_in  # the input really has a full band
    page = Chromium(live.base + "/")
    try:
        assert page.wait_for("document.readyState === 'complete' && !!window.fileState", 20)
        assert page.evaluate("[document.getElementById('file-band').value, window.fileState.band]") == ["full", "full"]
        page.evaluate("document.getElementById('file-atten').value = '6'")
        page.choose_files(lambda: page.evaluate("document.getElementById('drop').click()", user_gesture=True), [wav])
        assert page.wait_for(READY, 60)
        state = page.evaluate("window.fileState")
        assert state["status"] == "ready" and (state["band"], state["atten"], state["sampleRate"]) == ("full", 6, sr), state
        assert state["downloadName"] == "fullband-enhanced-6dB.wav", state
        full = blob_bytes(page)
        assert full == rest(live.base, wav, "audio/wav", atten_lim_db=6)
        y, rate = sf.read(io.BytesIO(full))
        assert rate == sr and len(y) == len(x)
        kept = band_energy(y, sr, 9000) / upper_in
        assert kept > 0.15, f"band=full kept only {kept:.1%} of the energy above 9 kHz"
        original = lit_above(page, "spec-original", 9000, sr / 2)
        enhanced = lit_above(page, "spec-enhanced", 9000, sr / 2)
        assert original["above"] > 0.3, original  # the original's upper band is drawn
        assert enhanced["above"] > 0.5 * original["above"], (enhanced, original)
        page.evaluate("window.scrollTo(0, 0)")
        shot(page, "file-view-full-band.png", capsys)

        # band=speech: the same file again, nothing above 8 kHz, the band below kept
        page.evaluate("(s => { s.value = 'speech'; s.dispatchEvent(new Event('change')); })"
                      "(document.getElementById('file-band'))", user_gesture=True)
        assert page.wait_for("window.fileState.runs === 2 && window.fileState.status === 'ready'", 60), \
            page.evaluate("window.fileState")
        state = page.evaluate("window.fileState")
        assert (state["band"], state["atten"]) == ("speech", 6) and state["downloadName"] == "fullband-enhanced-6dB-speech.wav"
        assert "speech band only" in page.evaluate("document.getElementById('file-info').textContent")
        speech = blob_bytes(page)
        assert speech == rest(live.base, wav, "audio/wav", atten_lim_db=6, band="speech")
        z, _ = sf.read(io.BytesIO(speech))
        assert len(z) == len(x)
        left = band_energy(z, sr, 9000) / upper_in
        assert left < 0.01 * kept, f"band=speech left {left:.3%} of the energy above 9 kHz (full kept {kept:.1%})"
        low_full, low_speech = band_energy(y, sr, 100, 7500), band_energy(z, sr, 100, 7500)
        assert 0.5 < low_speech / low_full < 2, (low_speech, low_full)  # the speech band is not what changed
        cut = lit_above(page, "spec-enhanced", 9000, sr / 2)
        assert cut["above"] < 0.05 * original["above"], (cut, original)
        assert cut["below"] > 0.5 * enhanced["below"], (cut, enhanced)
        assert lit_above(page, "spec-original", 9000, sr / 2) == original  # the original is drawn as before
        shot(page, "file-view-speech-band.png", capsys)
        assert page.errors() == []
    finally:
        page.close()
    live.wait_idle()


def refused_upload_lines(errors: list[str], statuses: set[int]) -> list[str]:
    """The errors that are not Chromium's own log line for an upload answered with one of `statuses`."""
    expected = tuple(f"log (network): Failed to load resource: the server responded with a status of {s}" for s in statuses)
    return [e for e in errors if not (e.startswith(expected) and "/v1/enhance" in e)]


def test_file_view_shows_server_errors_in_words(live, browser_available, tmp_path):
    """Not audio (415), too long (413), truncated (422), too large (refused before uploading, from
    the server's limit), busy (503 with Retry-After): each is shown as a sentence, nothing else fails."""
    notes = tmp_path / "notes.txt"
    notes.write_text("these are meeting notes, not audio\n" * 20)
    long = tmp_path / "long.wav"
    sf.write(long, np.zeros(8000 * 31, np.int16), 8000, subtype="PCM_16")  # the test server takes 30 s
    truncated = tmp_path / "cut.wav"
    truncated.write_bytes(noisy_wav(tmp_path).read_bytes()[:40000])
    huge = tmp_path / "huge.wav"
    huge.write_bytes(b"\0" * (live.settings.max_upload_bytes + 1))
    page = Chromium(live.base + "/")
    try:
        assert page.wait_for("document.readyState === 'complete' && !!window.fileState "
                             "&& document.getElementById('file-limits').textContent !== ''", 20)
        cases = [(notes, 415, "unsupported_media", "This is not an audio file the server can read"),
                 (long, 413, "too_long", "The recording is too long"),
                 (truncated, 422, "invalid_audio", "The audio file is damaged or not supported"),
                 (huge, 413, "too_large", "The file is too large")]
        for path, status, kind, title in cases:
            page.choose_files(lambda: page.evaluate("document.getElementById('drop').click()", user_gesture=True), [path])
            assert page.wait_for(READY, 30)
            err = page.evaluate("window.fileState.error")
            assert err and (err["status"], err["kind"], err["title"]) == (status, kind, title), err
            shown = page.evaluate("[document.getElementById('file-error').hidden, document.getElementById('file-error').innerText]")
            assert shown[0] is False and title in shown[1] and len(shown[1]) > len(title) + 20, shown
            assert "{" not in shown[1] and "Traceback" not in shown[1], shown
            assert page.evaluate("document.getElementById('file-result').hidden") is True
            if kind in ("too_long", "too_large"):  # the words name the limit
                assert ("30 s" if kind == "too_long" else "2.9 MB") in err["text"], err

        # a busy server (503 over_capacity, Retry-After: 3), answered by the browser's network layer
        page.call("Fetch.enable", patterns=[{"urlPattern": "*/v1/enhance*"}])
        since = len(page.events)
        page.choose_files(lambda: page.evaluate("document.getElementById('drop').click()", user_gesture=True),
                          [noisy_wav(tmp_path)])
        paused = page.wait_event("Fetch.requestPaused", since, timeout=20)
        assert paused is not None
        body = {"error": {"kind": "over_capacity", "message": "over capacity: all 4 enhancement slots are busy", "retry_after_s": 3}}
        page.call("Fetch.fulfillRequest", requestId=paused["params"]["requestId"], responseCode=503,
                  responseHeaders=[{"name": "Content-Type", "value": "application/json"}, {"name": "Retry-After", "value": "3"}],
                  body=base64.b64encode(json.dumps(body).encode()).decode())
        page.call("Fetch.disable")
        assert page.wait_for(READY, 20)
        err = page.evaluate("window.fileState.error")
        assert (err["status"], err["title"]) == (503, "The server is busy") and "Try again in 3 s" in err["text"], err
        assert refused_upload_lines(page.errors(), {413, 415, 422, 503}) == []
    finally:
        page.close()
    live.wait_idle()


NO_OVERFLOW = "document.documentElement.scrollWidth <= window.innerWidth && document.body.scrollWidth <= window.innerWidth"


def test_phone_sized_window_both_views_without_horizontal_overflow(live, browser_available, tmp_path, capsys):
    """390 x 844 CSS px with touch (a phone): the file view with a result and the live view while
    streaming both fit the width (no horizontal scrolling) and work."""
    wav = noisy_wav(tmp_path)
    page = Chromium(live.base + "/", wav, width=390, height=844, mobile=True)
    try:
        assert page.wait_for("document.readyState === 'complete' && !!window.fileState", 20)
        assert page.evaluate("window.innerWidth") == 390
        assert page.evaluate(NO_OVERFLOW), page.evaluate("[document.documentElement.scrollWidth, innerWidth]")
        page.choose_files(lambda: page.evaluate("document.getElementById('drop').click()", user_gesture=True), [wav])
        assert page.wait_for("window.fileState.status === 'ready'", 60), page.evaluate("window.fileState")
        page.evaluate("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
        assert page.evaluate(NO_OVERFLOW), page.evaluate("[document.documentElement.scrollWidth, innerWidth]")
        widths = page.evaluate("['spec-original', 'spec-enhanced'].map(id => document.getElementById(id).getBoundingClientRect().right)")
        assert all(0 < w <= 390 for w in widths), widths
        assert drawn(page, "spec-enhanced")["lit"] > 0.2
        shot(page, "file-view-narrow.png", capsys)

        page.evaluate("document.getElementById('tab-live').click()", user_gesture=True)
        assert page.wait_for("document.body.dataset.view === 'live'", 5)
        page.evaluate("document.getElementById('start').click()", user_gesture=True)
        assert page.wait_for("window.demoState.status === 'streaming' && window.demoState.spectrogramColumns.output > 50", 40), \
            page.evaluate("window.demoState")
        assert page.evaluate(NO_OVERFLOW), page.evaluate("[document.documentElement.scrollWidth, innerWidth]")
        page.evaluate("window.scrollTo(0, 0)")
        shot(page, "live-view-narrow.png", capsys)
        page.stop_live(1.5)
        assert page.errors() == []
    finally:
        page.close()
    live.wait_idle()


def test_with_an_api_key_typed_in_or_in_the_address(live_auth, browser_available, tmp_path):
    """A server with an API key: without one the upload is refused in words and the key field gets
    the focus; a wrong key is refused; the right key typed in works. Opened as /?api_key=KEY, the
    page uses the key for the upload (header) and for the microphone stream (query)."""
    key = live_auth.settings.api_key
    wav = noisy_wav(tmp_path)
    def choose(page):
        return page.choose_files(
            lambda: page.evaluate("document.getElementById('drop').click()", user_gesture=True), [wav])

    page = Chromium(live_auth.base + "/")
    try:
        assert page.wait_for("document.readyState === 'complete' && !document.getElementById('key-label').hidden", 20)
        choose(page)
        assert page.wait_for(READY, 30)
        err = page.evaluate("window.fileState.error")
        assert (err["status"], err["title"]) == (401, "An API key is needed"), err
        assert page.evaluate("document.activeElement.id") == "api-key"
        page.call("Input.insertText", text="not-the-key")
        choose(page)
        assert page.wait_for(READY, 30)
        assert page.evaluate("window.fileState.error.title") == "The API key is not valid"
        page.evaluate("document.getElementById('api-key').value = ''")
        page.evaluate("document.getElementById('api-key').focus()")
        page.call("Input.insertText", text=key)
        choose(page)
        assert page.wait_for(READY, 60)
        assert page.evaluate("window.fileState.status") == "ready", page.evaluate("window.fileState")
        assert refused_upload_lines(page.errors(), {401, 403}) == []
    finally:
        page.close()
    live_auth.wait_idle()

    page = Chromium(live_auth.base + f"/?api_key={key}#live", wav)
    try:
        assert page.wait_for("document.readyState === 'complete' && !!window.demoState", 20)
        assert page.evaluate("[document.getElementById('key-label').hidden, document.getElementById('api-key').value]") == [False, key]
        page.evaluate("document.getElementById('start').click()", user_gesture=True)
        assert page.wait_for("window.demoState.status === 'streaming' && window.demoState.enhancedSamples > 24000", 40), \
            page.evaluate("window.demoState")
        page.stop_live(1.0)
        live_auth.wait_idle()
        page.evaluate("location.hash = '#file'")
        choose(page)
        assert page.wait_for(READY, 60)
        assert page.evaluate("window.fileState.status") == "ready", page.evaluate("window.fileState")
        assert page.errors() == []
    finally:
        page.close()
    live_auth.wait_idle()
