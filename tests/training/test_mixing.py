"""The DNS-style mixer and the example stream: SNR, levels, clipping, reproducibility, bandwidth."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from enhancer import ModelConfig
from tests.conftest import speechlike
from training.data.audio_cache import AudioSet
from training.data.manifests import DataError, Item
from training.data.mixing import active_rms, fit_length, level_db, mix, snr_db
from training.data.synthesis import MixConfig, Synthesizer, validation_set
from training.losses.objective import band_weight


@pytest.mark.parametrize("snr", [0.0, 7.5, 25.0, 40.0])
@pytest.mark.parametrize("level", [-35.0, -15.0])
def test_mix_hits_snr_and_level(snr, level):
    clean = speechlike(32000, seed=1)
    noise = (np.random.default_rng(2).standard_normal(32000) * 0.3).astype(np.float32)
    noisy, c = mix(clean, noise, snr, level)
    assert abs(snr_db(c, noisy - c) - snr) < 0.1
    if np.abs(noisy).max() < 0.99 - 1e-6:
        assert abs(level_db(c) - level) < 0.1
    else:  # scaled down together to avoid clipping
        assert level_db(c) < level and np.abs(noisy).max() == pytest.approx(0.99, rel=1e-6)
    assert noisy.dtype == np.float32 and noisy.shape == clean.shape


def test_mix_never_clips_and_keeps_snr():
    clean = speechlike(32000, seed=3)
    noise = np.zeros(32000, np.float32)
    noise[::4000] = 1.0  # sparse clicks: active RMS low, peaks huge
    for level in (-15.0, -5.0, 0.0):
        for snr in (0.0, 3.0):
            noisy, c = mix(clean, noise, snr, level)
            assert np.abs(noisy).max() <= 0.99 + 1e-6 and np.abs(c).max() <= 0.99 + 1e-6
            assert abs(snr_db(c, noisy - c) - snr) < 0.1


def test_noise_free_example_and_silence_errors():
    clean = speechlike(16000, seed=4)
    noisy, c = mix(clean, None, 10.0, -25.0)
    np.testing.assert_array_equal(noisy, c)
    with pytest.raises(ValueError, match="silent"):
        mix(np.zeros(1000, np.float32), None, 10.0, -25.0)


def test_active_rms_ignores_pauses():
    x = speechlike(16000, seed=5)
    padded = np.concatenate([x, np.zeros(16000, np.float32)])
    assert abs(active_rms(padded) / active_rms(x) - 1.0) < 0.02
    assert active_rms(np.zeros(640)) == 0.0


def test_fit_length_crops_and_loops():
    rng = np.random.default_rng(0)
    x = np.arange(10, dtype=np.float32)
    y = fit_length(x, 25, rng)
    assert len(y) == 25 and set(np.diff(y)) <= {1.0, -9.0}  # a looped ramp
    z = fit_length(np.arange(100, dtype=np.float32), 30, rng)
    assert len(z) == 30 and np.all(np.diff(z) == 1.0)


def _sets():
    items, clips = [], []
    for g in range(4):
        for i in range(3):
            bw = 7000.0 if g == 3 else 8000.0
            items.append(Item(f"/s/{g}/{i}.wav", 0.5, 16000, f"{'g722' if g == 3 else 'libri'} {g}", bw))
            clips.append(speechlike(8000 + 1000 * i, seed=10 * g + i))
    speech = AudioSet.from_arrays(items, clips)
    r = np.random.default_rng(1)
    noise = AudioSet.from_arrays([Item(f"/n/{i}.wav", group=f"n{i % 2}") for i in range(3)],
                                 [(0.1 * r.standard_normal(12000)).astype(np.float32) for _ in range(3)])
    music = AudioSet.from_arrays([Item("/m/0.wav", group="m")], [speechlike(20000, seed=99)])
    return speech, noise, music


def test_examples_are_reproducible_and_seed_dependent():
    speech, noise, music = _sets()
    cfg = MixConfig(segment_seconds=1.0)
    a = Synthesizer(speech, noise, music, cfg, seed=7)
    b = Synthesizer(speech, noise, music, cfg, seed=7)
    c = Synthesizer(speech, noise, music, cfg, seed=8)
    for i in (0, 5, 123):
        ea, eb = a.example(i), b.example(i)
        np.testing.assert_array_equal(ea.noisy, eb.noisy)
        np.testing.assert_array_equal(ea.clean, eb.clean)
        assert ea.info == eb.info
    assert not np.array_equal(a.example(0).noisy, c.example(0).noisy)
    assert not np.array_equal(a.example(0).noisy, a.example(1).noisy)
    # a batch is the examples themselves, in order, whatever the order of generation
    noisy, _clean, _bw = a.batch([123, 5])
    np.testing.assert_array_equal(noisy[1], a.example(5).noisy)


def test_stream_properties_over_many_examples():
    speech, noise, music = _sets()
    cfg = MixConfig(segment_seconds=1.0, p_clean=0.1)
    s = Synthesizer(speech, noise, music, cfg, seed=0)
    kinds, bws = set(), set()
    for i in range(200):
        e = s.example(i)
        assert e.noisy.shape == (16000,) and np.abs(e.noisy).max() <= 0.99 + 1e-6
        kinds.add(e.info["noise"])
        bws.add(e.bandwidth_hz)
        if e.info["noise"] == "none":
            np.testing.assert_array_equal(e.noisy, e.clean)
        else:
            assert abs(snr_db(e.clean, e.noisy - e.clean) - e.info["snr_db"]) < 0.1
            assert 0.0 <= e.info["snr_db"] <= 40.0
        assert level_db(e.clean) <= -15.0 + 0.1
        assert e.bandwidth_hz == (7000.0 if e.info["group"].startswith("g722") else 8000.0)
    assert kinds == {"none", "noise", "music", "babble"}
    assert bws == {7000.0, 8000.0}


def test_sources_are_drawn_by_source_not_by_clip():
    speech, noise, music = _sets()
    s = Synthesizer(speech, noise, music, MixConfig(segment_seconds=0.5), seed=0)
    shares = s.speech.shares()
    assert shares == {"g722": round(1 / (1 + 3 ** 0.5), 3), "libri": round(3 ** 0.5 / (1 + 3 ** 0.5), 3)}
    s2 = Synthesizer(speech, noise, music, MixConfig(segment_seconds=0.5, source_weights={"g722": 0.0}), seed=0)
    assert all(not s2.example(i).info["group"].startswith("g722") for i in range(40))


def test_noise_weights_set_the_noise_sources_shares_and_refuse_unknown_sources():
    speech, noise, music = _sets()
    assert Synthesizer(speech, noise, music, MixConfig(segment_seconds=0.5)).noise.shares() == {"n0": 0.5, "n1": 0.5}
    s = Synthesizer(speech, noise, music, MixConfig(segment_seconds=0.5, noise_weights={"n0": 3.0}), seed=0)
    assert s.noise.shares() == {"n0": 0.75, "n1": 0.25}
    off = Synthesizer(speech, noise, music, MixConfig(segment_seconds=0.5, noise_weights={"n1": 0.0}), seed=0)
    rng = np.random.default_rng(0)
    assert {off.noise.group_names[off.noise.group(rng)] for _ in range(50)} == {"n0"}
    with pytest.raises(DataError, match="lacks: ambient"):
        Synthesizer(speech, noise, music, MixConfig(segment_seconds=0.5, noise_weights={"ambient": 2.0}))
    with pytest.raises(ValueError, match="noise_weights"):
        MixConfig(noise_weights={"n0": -1.0}).validate()
    # the validation set draws its noises by the default rule, whatever the run's weights name
    a = validation_set(speech, noise, music, MixConfig(segment_seconds=1.0), 3, 1.0, None, log=lambda *_: None)
    b = validation_set(speech, noise, music, MixConfig(segment_seconds=1.0, noise_weights={"ambient": 5.0}), 3, 1.0,
                       None, log=lambda *_: None)
    np.testing.assert_array_equal(a["noisy"], b["noisy"])


def test_band_weight_masks_above_bandwidth():
    cfg = ModelConfig.preset("tim")
    w = band_weight(torch.tensor([7000.0, 8000.0]), cfg)  # (2, 1, 257)
    assert w.shape == (2, 1, 257)
    assert w[0, 0, :225].eq(1).all() and w[0, 0, 225:].eq(0).all()  # 224 * 31.25 Hz = 7000 Hz
    assert w[1].eq(1).all()


def test_validation_set_is_fixed_and_cached(tmp_path):
    speech, noise, music = _sets()
    cfg = MixConfig(segment_seconds=1.0)
    a = validation_set(speech, noise, music, cfg, 6, 1.5, tmp_path, log=lambda *_: None)
    assert a["noisy"].shape == (6, 24000) and a["bandwidth_hz"].shape == (6,)
    assert len(list(tmp_path.glob("valid-*.npz"))) == 1
    b = validation_set(speech, noise, music, cfg, 6, 1.5, tmp_path, log=lambda *_: None)
    np.testing.assert_array_equal(a["noisy"], b["noisy"])
    c = validation_set(speech, noise, music, cfg, 6, 1.5, None)  # regenerated, not read
    np.testing.assert_array_equal(a["clean"], c["clean"])
