"""Signal path: STFT round trip, numpy == torch, resampling, input checks."""
import numpy as np
import pytest
import torch

from enhancer import STFTConfig
from enhancer import signal as ns
from enhancer.build.model import features as tf
from enhancer.errors import AudioError
from tests.conftest import speechlike
from tests.tolerance import REL_PEAK, assert_close_to_peak


def test_window_pair_sums_to_one_at_half_overlap():
    w = ns.sqrt_hann(512).astype(np.float64)
    wsq = w * w
    np.testing.assert_allclose(wsq[:256] + wsq[256:], 1.0, atol=1e-6)


@pytest.mark.parametrize("n", [1, 255, 256, 257, 16000, 48123])
def test_stft_round_trip(n):
    x = speechlike(n, seed=n)
    spec = ns.stft(x)
    assert spec.shape == (ns.n_frames_for(n), 257)
    y = ns.istft(spec, n)
    assert y.shape == (n,)
    assert_close_to_peak(y, x, 1e-5)


def test_stft_batched_round_trip():
    x = np.stack([speechlike(5000, seed=s) for s in range(3)])
    assert_close_to_peak(ns.istft(ns.stft(x), 5000), x, 1e-5)


def test_numpy_and_torch_stft_agree():
    x = speechlike(12345, seed=3)
    a = ns.stft(x)
    b = tf.stft(torch.from_numpy(x)).numpy()
    assert_close_to_peak(a, b, REL_PEAK)
    # Log-magnitudes: a bin's log inherits |(|a| - |b|)| / (min(|a|, |b|) + eps) from the spectra (large
    # at quiet bins, whatever the CPU), plus float32 rounding: of |X| + eps (relative, so additive after
    # the log) and of the log itself.
    eps = 1e-4
    fa = ns.log_magnitude(a, eps)
    fb = tf.log_magnitude(torch.from_numpy(b), eps).numpy()
    ma, mb = np.abs(a).astype(np.float64), np.abs(b).astype(np.float64)
    f32 = np.finfo(np.float32).eps
    inherited = (np.abs(ma - mb) / (np.minimum(ma, mb) + eps) + 4 * f32
                 + 2 * np.spacing(np.maximum(np.abs(fa), np.abs(fb))))
    excess = np.abs(fa.astype(np.float64) - fb) / inherited
    assert excess.max() <= 1.0, f"log-magnitudes differ by {excess.max():.3g} x what the spectra explain"
    # Where well conditioned (within 40 dB of the peak) the two agree in dB as closely as the spectra allow.
    loud = np.maximum(ma, mb) >= 1e-2 * ma.max()
    db = 20 / np.log(10) * np.abs(fa.astype(np.float64) - fb)[loud]
    assert loud.mean() > 0.3 and db.max() <= 20 * np.log10(1 + REL_PEAK / 1e-2)
    assert_close_to_peak(tf.istft(torch.from_numpy(a), 12345).numpy(), ns.istft(a, 12345), REL_PEAK)


def test_dft_bases_match_rfft():
    cfg = STFTConfig()
    fwd, inv = tf.dft_bases(cfg)
    frame = speechlike(512, seed=9)
    spec = np.fft.rfft(frame * ns.sqrt_hann(512))
    got = frame @ fwd
    assert_close_to_peak(got[:257] + 1j * got[257:], spec, REL_PEAK)
    back = np.concatenate([spec.real, spec.imag]).astype(np.float32) @ inv
    assert_close_to_peak(back, np.fft.irfft(spec, 512) * ns.sqrt_hann(512), REL_PEAK)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_resample_round_trip(rate):
    x = speechlike(16000, seed=1)
    up = ns.resample(x, 16000, rate)
    assert abs(up.shape[0] - rate) <= 1
    back = ns.resample(up, rate, 16000)
    assert abs(back.shape[0] - 16000) <= 1
    if rate > 16000:  # nothing above 8 kHz is lost going up and back down
        n = min(len(back), 16000)
        err = back[200:n - 200] - x[200:n - 200]
        assert np.sqrt(np.mean(err ** 2)) < 0.05 * np.sqrt(np.mean(x ** 2))


def test_resample_keeps_channels():
    x = speechlike(8000, channels=3)
    y = ns.resample(x, 16000, 44100)
    assert y.shape[1] == 3 and abs(y.shape[0] - 22050) <= 1


@pytest.mark.parametrize("bad, match", [
    (np.zeros(0, np.float32), "empty"),
    (np.zeros((4, 4, 4), np.float32), "shape"),
    (np.array([0.0, np.nan, 0.1], np.float32), "NaN or Inf"),
    (np.array([0.0, np.inf], np.float32), "NaN or Inf"),
    (np.array(["a", "b"]), "numeric"),
    (np.zeros((10, 0), np.float32), "0 channels"),
    (np.zeros((2, 1000), np.float32), "transposed"),
])
def test_check_audio_errors(bad, match):
    with pytest.raises(AudioError, match=match):
        ns.check_audio(bad)


@pytest.mark.parametrize("peak", [1e7, -1e7, 1e30])
def test_check_audio_refuses_huge_float_samples(peak):
    x = speechlike(1600)
    x[100] = peak
    with pytest.raises(AudioError, match=r"about \[-1, 1\]") as e:
        ns.check_audio(x)
    assert f"+-{ns.MAX_ABS_SAMPLE:g}" in str(e.value)
    x[100] = ns.MAX_ABS_SAMPLE  # the bound itself is accepted
    assert ns.check_audio(x)[100] == np.float32(ns.MAX_ABS_SAMPLE)


def test_enhancer_refuses_huge_samples_and_accepts_loud_ones(enhancer_rt):
    x = speechlike(4000, seed=7)
    loud = x * (10.0 / np.abs(x).max())  # peak 10: far above full scale, within the bound
    y = enhancer_rt.enhance(loud, 16000)
    assert y.shape == loud.shape and np.isfinite(y).all()
    huge = x.copy()
    huge[2000] = 1e7
    with pytest.raises(AudioError, match=r"about \[-1, 1\]"):
        enhancer_rt.enhance(huge, 16000)
    s = enhancer_rt.stream(16000)
    s.feed(x[:1000])
    with pytest.raises(AudioError, match=r"1e\+06"):
        s.feed(huge[1000:3000])


def test_integer_pcm_is_scaled():
    x = np.array([-32768, 0, 16384], np.int16)
    np.testing.assert_allclose(ns.check_audio(x), [-1.0, 0.0, 0.5])
    u = np.array([0, 128, 255], np.uint8)
    np.testing.assert_allclose(ns.check_audio(u), [-1.0, 0.0, 127 / 128])


@pytest.mark.parametrize("rate", [0, -16000, 999, 10**9, 16000.5, "fast", None, float("inf"), float("nan")])
def test_absurd_rates_are_rejected(rate):
    with pytest.raises(AudioError, match="sample rate"):
        ns.check_rate(rate)
