"""Full band above 16 kHz: the band above 8 kHz kept beside the model's (`enhancer.fullband`).

Streaming == offline in any chunking, output length == input length, mono and stereo at 22.05,
32, 44.1 and 48 kHz; the batched cursor path (what the service drives) gives the same output;
16 kHz and below are untouched by the band switch; the upper band is there with band="full" and
gone with band="speech"."""
import numpy as np
import pytest

from enhancer.errors import AudioError
from enhancer.fullband import check_band
from tests.conftest import speechlike
from tests.tolerance import assert_close_to_peak

RATES = [22050, 32000, 44100, 48000]


def noisy(sr: int, seconds: float, channels: int = 0, seed: int = 0) -> np.ndarray:
    """Harmonic bursts with broadband noise (content up to the Nyquist frequency)."""
    x = speechlike(int(seconds * sr), sr=sr, seed=seed, channels=channels)
    r = np.random.default_rng(seed + 1)
    return (x + 0.02 * r.standard_normal(x.shape)).astype(np.float32)


def chunked(stream, x, rng, max_len):
    parts, i = [], 0
    while i < len(x):
        k = int(rng.integers(1, max_len + 1))
        parts.append(stream.feed(x[i:i + k]))
        i += k
    parts.append(stream.flush())
    return np.concatenate(parts, axis=0)


def band_pass(x: np.ndarray, sr: int, lo: float, hi: float = np.inf) -> np.ndarray:
    """`x` with only its content between `lo` and `hi` Hz (float64)."""
    spec = np.fft.rfft(np.asarray(x, np.float64))
    f = np.fft.rfftfreq(len(x), 1 / sr)
    spec[(f < lo) | (f > hi)] = 0
    return np.fft.irfft(spec, len(x))


def voice_air(clean: np.ndarray, sr: int, lo: float = 8500.0) -> np.ndarray:
    """An upper band for a voice recorded at 16 kHz: its own 4-7.8 kHz band shifted up by 4.5 kHz,
    kept above `lo` and 3 dB down (the fricatives' spectrum, timing and level above 8 kHz, as in
    full-band recordings of speech)."""
    shifted = band_pass(clean, sr, 4000.0, 7800.0) * 2 * np.cos(2 * np.pi * 4500 * np.arange(len(clean)) / sr)
    return band_pass(shifted, sr, lo) * 10 ** (-3 / 20)


def upper_share(y: np.ndarray, sr: int) -> float:
    y = y if y.ndim == 1 else y[:, 0]
    p = np.abs(np.fft.rfft(y)) ** 2
    return float(p[np.fft.rfftfreq(len(y), 1 / sr) > 8500].sum() / p.sum())


@pytest.mark.parametrize("sr", RATES)
@pytest.mark.parametrize("channels", [1, 2])
def test_streaming_equals_offline_in_any_chunking(enhancer_rt, sr, channels):
    x = noisy(sr, 1.2, channels if channels > 1 else 0, seed=sr)
    ref = enhancer_rt.enhance(x, sr)
    assert ref.shape == x.shape and ref.dtype == np.float32
    rng = np.random.default_rng(sr + channels)
    for max_len in (1 if sr == 22050 else 7, 300, 5000):
        got = chunked(enhancer_rt.stream(sr, channels), x, rng, max_len)
        assert got.shape == ref.shape
        assert_close_to_peak(got, ref)
    if channels == 2:  # channels are independent
        assert_close_to_peak(ref[:, 1], enhancer_rt.enhance(x[:, 1], sr))


@pytest.mark.parametrize("n", [1, 37, 700, 1411, 20000])
def test_output_length_equals_input_length(enhancer_rt, n):
    x = noisy(44100, n / 44100 + 1e-9, seed=n)[:n]
    assert enhancer_rt.enhance(x, 44100).shape == (n,)
    s = enhancer_rt.stream(44100)
    assert chunked(s, x, np.random.default_rng(n), 100).shape == (n,)


def test_batched_cursor_path_equals_offline(enhancer_rt):
    """The service's batcher: one hop per call (take_hop/step/put_output with activity), skips
    none; the same output as `Enhancer.enhance`."""
    sr = 48000
    x = noisy(sr, 1.0, 2, seed=3)
    s = enhancer_rt.stream(sr, 2)
    c = s.cursor
    out, i = [], 0
    while i < len(x):
        c.push(x[i:i + 960])
        i += 960
        while c.ready_hops():
            r = c.pool.step(c.lanes, c.take_hop(), c.gains)
            c.put_output(r.out, r.competition, r.activity)
        out.append(c.pull())
    c.begin_flush()
    while c.ready_hops():
        r = c.pool.step(c.lanes, c.take_hop(), c.gains)
        c.put_output(r.out, r.competition, r.activity)
    out.append(c.end_flush())
    got = np.concatenate(out)
    assert got.shape == x.shape
    assert_close_to_peak(got, enhancer_rt.enhance(x, sr))


def test_skipped_hops_keep_the_length(enhancer_rt):
    sr = 44100
    x = noisy(sr, 1.0, seed=4)
    c = enhancer_rt.stream(sr).cursor
    c.push(x)
    c.skip(5)
    while n := c.ready_hops():
        r = c.pool.run(c.lanes, c.take_hops(n), c.gains)
        c.put_outputs(r.out, r.competition, r.activity)
    first = c.pull()
    c.begin_flush()
    while n := c.ready_hops():
        r = c.pool.run(c.lanes, c.take_hops(n), c.gains)
        c.put_outputs(r.out, r.competition, r.activity)
    y = np.concatenate([first, c.end_flush()])
    assert y.shape == (len(x), 1) and np.isfinite(y).all()


@pytest.mark.parametrize("sr", [8000, 16000])
def test_16k_and_below_the_band_changes_nothing(enhancer_rt, sr):
    x = noisy(sr, 0.8, 2, seed=5)
    assert np.array_equal(enhancer_rt.enhance(x, sr), enhancer_rt.enhance(x, sr, band="speech"))
    assert not enhancer_rt.stream(sr).cursor.full_band


@pytest.mark.parametrize("sr", RATES)
def test_full_band_keeps_the_upper_band_and_speech_drops_it(sr):
    """The shipped model on real speech (the golden Voicebank+DEMAND cut, taken up to `sr`) with the
    voice's upper band (`voice_air`): full keeps it while the voice speaks, speech drops it."""
    import soxr

    from enhancer.runtime import Enhancer
    from tests.golden_update import load_pair

    enh = Enhancer.from_pretrained(providers=["CPUExecutionProvider"])
    noisy16, clean16 = load_pair()
    noisy16, clean16 = noisy16[:3 * 16000], clean16[:3 * 16000]
    x = soxr.resample(noisy16, 16000, sr).astype(np.float32)
    x = (x + voice_air(soxr.resample(clean16, 16000, sr)[:len(x)], sr)).astype(np.float32)  # none of it below 8.5 kHz
    full, speech = enh.enhance(x, sr), enh.enhance(x, sr, band="speech")
    assert full.shape == speech.shape == x.shape
    assert upper_share(speech, sr) < 1e-3 * upper_share(x, sr)
    assert upper_share(full, sr) > 0.5 * upper_share(x, sr)


def test_band_is_checked(enhancer_rt):
    assert check_band("full") == "full" and check_band("speech") == "speech"
    for bad in ("wide", None, 1):
        with pytest.raises(AudioError, match="band"):
            enhancer_rt.stream(48000, band=bad)


@pytest.mark.parametrize("sr,channels", [(44100, 2), (32000, 1)])
def test_cli_band(enhancer_rt, model_path, tmp_path, sr, channels):
    """`enhancer denoise` keeps the full band by default; `--band speech` gives the model's band."""
    import soundfile as sf

    from enhancer.cli import main

    x = noisy(sr, 0.9, channels if channels > 1 else 0, seed=7)
    src = tmp_path / "in.wav"
    sf.write(src, x, sr, subtype="FLOAT")
    for band in ("full", "speech"):
        dst = tmp_path / f"{band}.wav"
        args = ["denoise", str(src), "-o", str(dst), "--model", str(model_path), "-q"]
        assert main(args + ([] if band == "full" else ["--band", "speech"])) == 0
        y, got_sr = sf.read(dst, dtype="float32")
        assert got_sr == sr and y.shape == x.shape
        assert_close_to_peak(y, enhancer_rt.enhance(x, sr, band=band))


def test_band_edges_follow_an_erb_scale_up_to_nyquist():
    from enhancer.fullband import LOW_HZ, band_edges

    for sr, bands in ((48000, 8), (44100, 7), (32000, 5)):
        e = band_edges(sr)
        assert len(e) == bands + 1 and e[0] == pytest.approx(LOW_HZ) and e[-1] == pytest.approx(sr / 2)
        assert np.all(np.diff(np.diff(e)) > 0)  # each band wider than the one below


def test_band_gains_close_pauses_and_keep_a_band_the_voice_fills():
    """Stationary noise alone: every gain 0 while the model hears no speech. Under speech, a band
    20 dB above that noise keeps most of itself, and the noise-only bands are held down."""
    import enhancer.fullband as fb

    sr, hop = 48000, 480
    g = fb.BandGains(sr, 2 * hop, hop, 1)
    rng = np.random.default_rng(0)
    f = np.fft.rfftfreq(2 * hop, 1 / sr)
    voiced = (f > 12000) & (f < 14000)
    for _ in range(150):
        noise = rng.exponential(1e-6, (1, len(f)))
        assert np.all(g.step(noise, np.zeros(1)) == 0.0)
    for _ in range(30):
        gains = g.step(rng.exponential(1e-6, (1, len(f))) * np.where(voiced, 100.0, 1.0), np.ones(1))
    assert gains[0, voiced].mean() > 0.8
    assert gains[0, (f > 8500) & (f < 10000)].mean() < 0.5


def test_noise_under_the_voice_is_removed_above_8_khz():
    """The shipped model on real speech (the golden Voicebank+DEMAND cut, taken to 48 kHz, with a
    second of silence inside) with the voice's upper band (`voice_air`), under a steady hiss above
    8 kHz as loud as the voice's upper band: in speech the hiss is removed by at least 2.5 dB (the
    input's upper-band noise over the output's upper-band error; a gate that opens with the voice
    removes none) with the voice's upper band within 3 dB of its level, and in the pause the band
    is at least 18 dB down."""
    import soxr

    from enhancer.runtime import Enhancer
    from tests.golden_update import load_pair
    from training.peers.fullband import upper_band

    sr = 48000
    enh = Enhancer.from_pretrained(providers=["CPUExecutionProvider"])
    _, clean16 = load_pair()
    clean16 = np.concatenate([clean16[:2 * 16000], np.zeros(16000, np.float32), clean16[2 * 16000:4 * 16000]])
    clean = soxr.resample(clean16, 16000, sr).astype(np.float64)
    rng = np.random.default_rng(1)
    clean = clean + voice_air(clean, sr)  # the voice's own upper band
    hiss = band_pass(rng.standard_normal(len(clean)), sr, 8500.0)
    hiss *= np.sqrt(np.mean(band_pass(clean, sr, 8500.0) ** 2) / np.mean(hiss ** 2))
    noisy = (clean + hiss).astype(np.float32)
    r = upper_band(clean.astype(np.float32), noisy, enh.enhance(noisy, sr), sr)
    assert r["pause_frames"] > 50 and r["speech_frames"] > 200, r
    assert r["hb_noise_removed_db"] >= 2.5, r
    assert abs(r["hb_speech_level_db"]) <= 3.0, r
    assert r["hb_pause_reduction_db"] >= 18.0, r


@pytest.mark.parametrize("sr", [44100, 48000])
def test_the_full_band_taken_to_16k_is_the_models_band(enhancer_rt, sr):
    """Below 8 kHz nothing is added back: the full-band output taken down to 16 kHz is the speech
    band's (so PESQ and DNSMOS of the full band are the 16 kHz path's)."""
    import soxr

    x = noisy(sr, 1.5, seed=9)
    full, speech = enhancer_rt.enhance(x, sr), enhancer_rt.enhance(x, sr, band="speech")
    assert upper_share(full, sr) > 10 * upper_share(speech, sr)  # the upper band is there
    down = [soxr.resample(y, sr, 16000, quality="VHQ") for y in (full, speech)]
    assert_close_to_peak(down[0], down[1], rel=1e-3)
