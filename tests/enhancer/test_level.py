"""The output level option (`level="input"`, enhancer.level): the voice back at the input's speech
level on real speech in noise, the default untouched bit for bit, streaming equal to offline, and
the gain's bounds, warm-up and chunking independence."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from enhancer.errors import AudioError
from enhancer.level import MAX_GAIN_DB, WARMUP_S, LevelGain
from enhancer.runtime import Enhancer, default_model_path
from tests.conftest import speechlike
from tests.tolerance import assert_close_to_peak, assert_differs

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden"
HOP = 256


@pytest.fixture(scope="module")
def shipped():
    return Enhancer.from_pretrained(default_model_path(), providers=["CPUExecutionProvider"])


def speech_level_db(x: np.ndarray, mask: np.ndarray) -> float:
    """Mean energy over the 16 ms frames in `mask`, in dB."""
    n = len(mask)
    return float(10 * np.log10(np.mean(x[:n * HOP].reshape(n, HOP)[mask] ** 2)))


def pink(n: int, seed: int) -> np.ndarray:
    spectrum = np.fft.rfft(np.random.default_rng(seed).standard_normal(n))
    f = np.arange(len(spectrum), dtype=np.float64)
    f[0] = 1.0
    return np.fft.irfft(spectrum / np.sqrt(f), n)


def babble(clean: np.ndarray, talkers: int = 5) -> np.ndarray:
    """A crowd: the voice itself, shifted by a different second or so for each talker."""
    return sum(np.roll(clean, 9000 + 7919 * k) for k in range(talkers))


@pytest.mark.parametrize("noise", ["pink", "babble"])
@pytest.mark.parametrize("snr_db", [10, 15, 20])
def test_input_level_gives_the_voice_back_at_the_input_speech_level(shipped, noise, snr_db):
    """The shipped model on a real recording (p287) in noise at 10-20 dB SNR: over the frames where
    the clean voice speaks (within 30 dB of its loudest frame), the model's output is quieter than
    the input, and with `level="input"` its level is within 1 dB of the input's and of the clean
    voice's."""
    clean, sr = sf.read(GOLDEN / "clean.flac", dtype="float64")
    n = pink(len(clean), seed=snr_db) if noise == "pink" else babble(clean)
    n *= np.sqrt(np.mean(clean ** 2) / np.mean(n ** 2)) / 10 ** (snr_db / 20)
    x = (clean + n).astype(np.float32)
    frames = len(clean) // HOP
    e = np.mean(clean[:frames * HOP].reshape(frames, HOP) ** 2, axis=1)
    speech = e > e.max() * 1e-3
    model = shipped.enhance(x, sr)
    restored = shipped.enhance(x, sr, level="input")
    at_input, at_clean = speech_level_db(x, speech), speech_level_db(clean, speech)
    lost = at_input - speech_level_db(model, speech)
    got = speech_level_db(restored, speech)
    assert lost > 0.5, f"the model's output is only {lost:.2f} dB quieter: nothing to restore"
    assert abs(got - at_input) <= 1.0, (got, at_input, lost)
    assert abs(got - at_clean) <= 1.0, (got, at_clean)
    assert abs(got - at_input) < lost  # closer to the input than the model's own level


def test_the_default_level_is_the_model_output_bit_for_bit(enhancer_rt, monkeypatch):
    """No level option, `level="model"`: the same samples, and no level gain is even made."""
    x1 = speechlike(16000 * 2, 16000, seed=11)
    x2 = speechlike(48000, 48000, seed=12, channels=2)
    before = [enhancer_rt.enhance(x1, 16000), enhancer_rt.enhance(x2, 48000)]

    def refuse(*a, **k):
        raise AssertionError("a level gain was made for level='model'")

    monkeypatch.setattr(LevelGain, "__init__", refuse)
    assert np.array_equal(enhancer_rt.enhance(x1, 16000, level="model"), before[0])
    assert np.array_equal(enhancer_rt.enhance(x2, 48000, level="model"), before[1])
    s = enhancer_rt.stream(48000, 2)
    y = np.concatenate([s.feed(x2[i:i + 960]) for i in range(0, len(x2), 960)] + [s.flush()])
    assert_close_to_peak(y, before[1])
    assert s.level == "model"


@pytest.mark.parametrize("rate,channels", [(16000, 1), (48000, 2), (22050, 1)])
def test_streaming_equals_offline_with_input_level(enhancer_rt, rate, channels):
    """Chunks of every size (and a 48 kHz stream with its upper band) give what offline
    enhancement gives; and the option really changed the output."""
    x = speechlike(int(2.5 * rate), rate, seed=13, channels=channels if channels > 1 else 0)
    offline = enhancer_rt.enhance(x, rate, level="input")
    assert offline.shape == x.shape
    assert_differs(offline, enhancer_rt.enhance(x, rate))
    r = np.random.default_rng(14)
    s = enhancer_rt.stream(rate, channels, level="input")
    parts, i = [], 0
    while i < len(x):
        k = int(r.integers(1, rate // 10))
        parts.append(s.feed(x[i:i + k]))
        i += k
    parts.append(s.flush())
    streamed = np.concatenate(parts)
    assert streamed.shape == x.shape
    assert_close_to_peak(streamed, offline)
    # louder than the model's own level: the gain restores what the model took
    assert np.mean(streamed ** 2) > np.mean(enhancer_rt.enhance(x, rate) ** 2)


def _hops(level: float, n: int, seed: int) -> np.ndarray:
    return (level * np.random.default_rng(seed).standard_normal((1, n, HOP))).astype(np.float32)


def _gains(lg: LevelGain, total: int, sizes) -> np.ndarray:
    """The gain per output sample, read back through `apply` in chunks of `sizes`."""
    out, start = [], 0
    for k in sizes:
        k = min(k, total - start)
        if k <= 0:
            break
        out.append(lg.apply(np.ones((k, 1), np.float32), start)[:, 0])
        start += k
    return np.concatenate(out)


def _fed(cfg, x: np.ndarray, y: np.ndarray, activity: np.ndarray) -> LevelGain:
    """A gain fed input hops x and output hops y (1, n, hop), delayed as the model delays them."""
    lg = LevelGain(cfg, 16000)
    la = lg.lookahead_hops
    pad = np.zeros((1, la, HOP), np.float32)
    lg.take(np.concatenate([x, pad], axis=1))
    lg.put(np.concatenate([pad, y], axis=1), np.concatenate([np.zeros((1, la)), activity], axis=1))
    return lg


def test_the_gain_is_the_speech_level_ratio_bounded_and_warmed_up(enhancer_rt):
    cfg = enhancer_rt.config
    n = 400  # 6.4 s
    x = _hops(0.1, n, 1)
    speech = np.ones((1, n))
    # output 6 dB below the input: +6 dB once warmed up (0.5 s of speech), a ramp before
    g = _gains(_fed(cfg, x, x * 0.5, speech), n * HOP, [n * HOP])
    warm = int(WARMUP_S * 16000)
    assert 20 * np.log10(g[-1]) == pytest.approx(6.02, abs=0.01)
    assert 20 * np.log10(g[warm // 2]) == pytest.approx(3.0, abs=0.3)
    assert np.all(np.diff(g[:warm]) >= -1e-6)  # rises to it
    # 40 dB quieter: bounded to MAX_GAIN_DB; louder than the input: never turned down
    assert 20 * np.log10(_gains(_fed(cfg, x, x * 0.01, speech), n * HOP, [n * HOP])[-1]) == pytest.approx(MAX_GAIN_DB)
    assert np.all(_gains(_fed(cfg, x, x * 2.0, speech), n * HOP, [n * HOP]) == 1.0)
    # no speech (activity below the ramp): the model's level, whatever the ratio
    assert np.all(_gains(_fed(cfg, x, x * 0.5, np.full((1, n), 0.1)), n * HOP, [n * HOP]) == 1.0)


def test_pauses_neither_count_nor_make_it_forget(enhancer_rt):
    """Loud noise the model calls a pause, between speech at 6 dB of loss: the gain stays at 6 dB."""
    cfg = enhancer_rt.config
    x = np.concatenate([_hops(0.1, 200, 2), _hops(0.5, 200, 3), _hops(0.1, 100, 4)], axis=1)
    y = x * 0.5
    y[:, 200:400] *= 0.01
    activity = np.concatenate([np.ones(200), np.zeros(200), np.ones(100)])[None]
    g = _gains(_fed(cfg, x, y, activity), 500 * HOP, [500 * HOP])
    assert np.allclose(20 * np.log10(g[199 * HOP:]), 6.02, atol=0.01)


def test_the_gain_does_not_depend_on_how_the_output_is_read(enhancer_rt):
    cfg = enhancer_rt.config
    n = 120
    x = _hops(0.1, n, 5)
    y = x * np.linspace(0.2, 0.9, n)[None, :, None].astype(np.float32)
    whole = _gains(_fed(cfg, x, y, np.ones((1, n))), n * HOP, [n * HOP])
    sizes = np.random.default_rng(6).integers(1, 700, size=n * HOP)
    assert np.array_equal(_gains(_fed(cfg, x, y, np.ones((1, n))), n * HOP, sizes), whole)


def test_an_unknown_level_is_refused_by_name(enhancer_rt):
    with pytest.raises(AudioError, match="level must be one of 'model', 'input', got 'loud'"):
        enhancer_rt.stream(16000, 1, level="loud")
    with pytest.raises(AudioError, match="level must be one of"):
        enhancer_rt.enhance(np.zeros(1600, np.float32), 16000, level=None)


def test_the_command_line_takes_level_input(tmp_path, model_path, enhancer_rt):
    """`enhancer denoise --level input` writes what `enhance(..., level="input")` returns; a level
    that does not exist is a usage error naming the choices."""
    from enhancer.cli import main

    x = speechlike(24000, 16000, seed=15, channels=2)
    sf.write(tmp_path / "in.wav", x, 16000, subtype="FLOAT")
    assert main(["denoise", str(tmp_path / "in.wav"), "-o", str(tmp_path / "out.wav"), "--model", str(model_path),
                 "--level", "input", "-q"]) == 0
    got, _ = sf.read(tmp_path / "out.wav", dtype="float32")
    assert_close_to_peak(got, enhancer_rt.enhance(x, 16000, level="input"))
    assert_differs(got, enhancer_rt.enhance(x, 16000))
    with pytest.raises(SystemExit) as e:
        main(["denoise", str(tmp_path / "in.wav"), "-o", str(tmp_path / "o.wav"), "--level", "loud"])
    assert e.value.code == 2
