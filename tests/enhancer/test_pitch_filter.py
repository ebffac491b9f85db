"""The pitch filter (`enhancer.build.model.pitchfilter`): the pitch search against a direct numpy YIN, the
comb against a direct numpy reference, what it does to a voice in noise, and the same output from
the offline torch reference, the torch step hop by hop and in chunks, the exported graph through
the runtime (streams in random chunks, batched lanes) and the CLI."""
import copy
import dataclasses
import json

import numpy as np
import pytest
import torch

from enhancer import ModelConfig
from enhancer.build.model import pitchfilter as pf
from enhancer.build.model.features import window
from enhancer.step_io import state_specs
from tests.conftest import assert_lanes_match_offline, check_export_flag, runtime_of, speechlike
from tests.enhancer.test_streaming import random_chunks, stream_through, torch_streaming
from tests.tolerance import assert_close_to_peak, assert_differs

CFG = ModelConfig.preset("tim", pitch_filter=0.7)
SR = 16000


def voiced(n: int, f0: float, seed: int = 0, snr_db: float | None = None) -> np.ndarray:
    """A harmonic tone at f0 (20 harmonics, falling 6 dB per octave), with white noise at snr_db."""
    t = np.arange(n) / SR
    x = sum(np.sin(2 * np.pi * k * f0 * t + k) / k for k in range(1, 21) if k * f0 < SR / 2)
    x = 0.1 * x / np.abs(x).max()
    if snr_db is not None:
        noise = np.random.default_rng(seed).standard_normal(n)
        x = x + noise * np.sqrt((x ** 2).mean() / (noise ** 2).mean() / 10 ** (snr_db / 10))
    return x.astype(np.float32)


def yin_reference(frame_hist: np.ndarray, win: np.ndarray) -> tuple[int, float]:
    """YIN on one history (LAG_MAX + n_fft samples), written lag by lag."""
    n = len(win)
    cur = frame_hist[-n:] * win
    d, nc = [], []
    for lag in range(1, pf.LAG_MAX + 1):
        past = frame_hist[pf.LAG_MAX - lag: pf.LAG_MAX - lag + n] * win
        d.append(((cur - past) ** 2).sum())
        nc.append((cur * past).sum() / np.sqrt((cur ** 2).sum() * (past ** 2).sum() + 1e-12))
    d = np.array(d)
    cm = d * np.arange(1, pf.LAG_MAX + 1) / np.maximum(np.cumsum(d), 1e-12)
    sub = cm[pf.LAG_MIN - 1:]
    below = np.nonzero(sub < pf.YIN_THRESHOLD)[0]
    if len(below):
        j = below[0]
        while j + 1 < len(sub) and sub[j + 1] < sub[j]:
            j += 1
    else:
        j = int(sub.argmin())
    return j + pf.LAG_MIN, nc[j + pf.LAG_MIN - 1]


@pytest.mark.parametrize("f0", [80.0, 123.0, 210.0, 390.0])
def test_pitch_search_finds_the_period_and_matches_the_reference(f0):
    n = pf.HISTORY
    x = voiced(4 * n, f0, snr_db=10)
    win = window(CFG.stft).numpy().astype(np.float64)
    hists = np.stack([x[i * 300: i * 300 + n] for i in range(5)]).astype(np.float64)
    bases = (torch.from_numpy(a).double() for a in pf.correlation_bases(win))
    lag, voicing = pf.yin(torch.from_numpy(hists)[None], torch.from_numpy(win), *bases)
    assert lag.shape == voicing.shape == (1, len(hists))
    for h, got_lag, got_v in zip(hists, lag[0].numpy(), voicing[0].numpy(), strict=True):
        ref_lag, ref_v = yin_reference(h, win)
        assert got_lag == ref_lag
        assert got_v == pytest.approx(ref_v, rel=1e-5)  # (the DFT bases are float32 values)
        assert abs(got_lag - SR / f0) <= 1.0  # the period, not a multiple or a fraction of it
        assert got_v > 0.6


def test_correlations_match_the_direct_sums():
    """The two-stage DFTs give each lag's correlation with the frame and windowed energy as summed directly."""
    rng = np.random.default_rng(3)
    win = window(CFG.stft).numpy().astype(np.float64)
    n, lag_max = len(win), pf.LAG_MAX
    hist = rng.standard_normal((2, 3, pf.HISTORY))
    kernel = np.zeros_like(hist)
    kernel[..., :n] = hist[..., lag_max:] * win * win
    bases = (torch.from_numpy(a).double() for a in pf.correlation_bases(win))
    corr, energy = (t.numpy() for t in pf.correlate(torch.from_numpy(hist), torch.from_numpy(kernel), *bases))
    assert corr.shape == energy.shape == (2, 3, lag_max + 1)
    past = np.stack([hist[..., lag_max - u: lag_max - u + n] for u in range(lag_max + 1)], axis=-2)  # (2, 3, lags, n)
    want_corr = (past * kernel[..., None, :n]).sum(-1)
    want_energy = (past ** 2 * win ** 2).sum(-1)
    assert_close_to_peak(corr, want_corr, rel=1e-5)
    assert_close_to_peak(energy, want_energy, rel=1e-5)


@pytest.mark.parametrize(("n_frames", "extra"), [(1, 0), (1, 300), (3, 0), (3, 192), (64, 100), (64, 300)])
def test_frames_are_the_signal_from_each_hop(n_frames, extra):
    """frames_at cuts frame t from sample t * hop, whether the signal runs past the last frame or not."""
    hop = CFG.stft.hop
    length = (n_frames - 1) * hop + pf.HISTORY + extra
    signal = torch.arange(2 * length, dtype=torch.float32).reshape(2, length)
    got = pf.frames_at(signal, n_frames, hop).numpy()
    want = np.stack([signal[:, t * hop: t * hop + pf.HISTORY].numpy() for t in range(n_frames)], axis=1)
    np.testing.assert_array_equal(got, want)


def comb_reference(cfg, x, p, gain, voiced_):
    """The comb of one frame, band by band (x, p complex (F,), gain (F,))."""
    member, interp = pf.bands(cfg)
    f = cfg.n_freqs
    r = np.zeros(member.shape[1])
    for b in range(member.shape[1]):
        k = member[:, b] > 0
        ex, ep = (np.abs(x[k]) ** 2).sum(), (np.abs(p[k]) ** 2).sum()
        c = (x[k] * p[k].conj()).real.sum() / np.sqrt(ex * ep + 1e-12)
        g = np.sqrt((gain[k] ** 2 * np.abs(x[k]) ** 2).sum() / (ex + 1e-12))
        rb = 1.0 if c > g else np.clip(c * c * (1 - g * g) / (1e-3 + g * g * (1 - c * c)), 0, 1)
        r[b] = np.sqrt(rb) * np.sqrt(ex / (ep + 1e-8)) * cfg.pitch_filter * (c > 0) * voiced_
    y = x + (r @ interp) * p
    e = np.array([(np.abs(y[member[:, b] > 0]) ** 2).sum() for b in range(member.shape[1])])
    ex = np.abs(x) ** 2 @ member
    return y * (np.sqrt(ex / (e + 1e-8)) @ interp)[:f]


def test_comb_matches_the_band_by_band_reference():
    rng = np.random.default_rng(2)
    f = CFG.n_freqs
    x = rng.standard_normal((3, f)) + 1j * rng.standard_normal((3, f))
    p = 0.7 * x + 0.5 * (rng.standard_normal((3, f)) + 1j * rng.standard_normal((3, f)))  # correlated
    gain = rng.uniform(0, 1, (3, f))
    v = np.array([1.0, 1.0, 0.0])
    ri = lambda z: torch.from_numpy(np.concatenate([z.real, z.imag], -1))[None]  # noqa: E731
    member, interp = (torch.from_numpy(a).double() for a in pf.bands(CFG))
    got = pf.comb(CFG, ri(x), ri(p), torch.from_numpy(gain)[None], torch.from_numpy(v)[None], member, interp)[0].numpy()
    got = got[:, :f] + 1j * got[:, f:]
    for t in range(3):
        ref = comb_reference(CFG, x[t], p[t], gain[t], v[t])
        np.testing.assert_allclose(got[t], ref, rtol=1e-9, atol=1e-12 * np.abs(ref).max())
    np.testing.assert_allclose(got[2], x[2], rtol=1e-7)  # unvoiced: unchanged
    # the frame's energy is kept (the bands' rescaling is interpolated between their centres)
    np.testing.assert_allclose((np.abs(got[:2]) ** 2).sum(-1), (np.abs(x[:2]) ** 2).sum(-1), rtol=0.05)


def harmonic_to_noise_db(y, clean, f0):
    """Energy at the harmonics of f0 over the energy between them, 0.2 to 4 kHz, over the file."""
    spec = np.abs(np.fft.rfft(y * np.hanning(len(y)))) ** 2
    hz = np.fft.rfftfreq(len(y), 1 / SR)
    band = (hz > 200) & (hz < 4000)
    dist = np.abs(((hz / f0 + 0.5) % 1.0) - 0.5) * f0  # distance to the nearest harmonic, Hz
    return 10 * np.log10(spec[band & (dist < 5)].sum() / spec[band & (dist > 30)].sum())


def test_removes_noise_between_harmonics_and_keeps_the_voice(torch_model):
    """A voiced tone in white noise at 5 dB, with gains that keep the noise's bins at 0.5: the filter
    raises the harmonic-to-noise ratio, keeps the harmonics' energy, and leaves unvoiced noise alone."""
    from enhancer.build.model.features import istft, stft

    f0, n = 150.0, SR * 2
    clean = voiced(n, f0)
    noisy = voiced(n, f0, seed=3, snr_db=5)
    wav = torch.from_numpy(noisy)[None]
    spec = stft(wav, CFG.stft)
    gains = torch.full(spec.shape, 0.5)
    out = istft(pf.filter_offline(CFG, wav, spec, gains) * gains, n, CFG.stft)[0].numpy()
    plain = istft(spec * gains, n, CFG.stft)[0].numpy()
    core = slice(SR // 4, n - SR // 4)
    gain_db = harmonic_to_noise_db(out[core], clean[core], f0) - harmonic_to_noise_db(plain[core], clean[core], f0)
    assert gain_db > 1.0, gain_db  # (one period-delayed copy at strength 0.7: at most 10 log10(1 + 0.7^2))
    assert 10 * np.log10((out[core] ** 2).sum() / (plain[core] ** 2).sum()) == pytest.approx(0.0, abs=1.0)
    noise = np.random.default_rng(4).standard_normal(n).astype(np.float32) * 0.03  # no voice: untouched
    wav = torch.from_numpy(noise)[None]
    spec = stft(wav, CFG.stft)
    y = pf.filter_offline(CFG, wav, spec, gains)
    np.testing.assert_allclose(y.numpy(), spec.numpy(), rtol=0, atol=1e-6 * spec.abs().max().item())


def test_off_by_default_and_stored_only_when_on():
    assert ModelConfig.preset("tim").pitch_filter == 0.0
    assert "pitch_filter" not in ModelConfig.preset("tim").to_dict()
    assert "pitch_x" not in [n for n, _ in state_specs(ModelConfig.preset("tim"))]
    d = CFG.to_dict()
    assert d["pitch_filter"] == 0.7 and ModelConfig.from_dict(json.loads(json.dumps(d))) == CFG
    assert [n for n, _ in state_specs(CFG)][-3:] == ["pitch_x", "pitch_y", "pitch_ola"]


@pytest.mark.parametrize("bad", [dict(pitch_filter=-0.1), dict(pitch_filter=3.0),
                                 dict(pitch_filter=0.5, pitch_filter_voicing=1.0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="pitch_filter"):
        ModelConfig.preset("tim", **bad)


def test_other_frames_are_refused():
    """The filter's lags and bases are for 16 kHz frames of 512 samples every 256."""
    from enhancer.config import STFTConfig

    assert ModelConfig.preset("tim", stft=STFTConfig(n_fft=1024, hop=512)).pitch_filter == 0.0  # fine without it
    with pytest.raises(ValueError, match="the pitch filter needs 16 kHz frames of 512"):
        ModelConfig.preset("tim", pitch_filter=0.5, stft=STFTConfig(n_fft=1024, hop=512))


@pytest.fixture(scope="module")
def filtered(torch_model):
    model = copy.deepcopy(torch_model)
    model.config = dataclasses.replace(model.config, pitch_filter=0.7, rise_limit_gain=0.3, gain_exponent=1.25)
    return model


@pytest.fixture(scope="module")
def filtered_rt(filtered, tmp_path_factory):
    return runtime_of(filtered, tmp_path_factory.mktemp("pitch"))


def test_step_graph_matches_torch(filtered, torch_model, filtered_rt, rng):
    x = voiced(SR * 3, 140.0, snr_db=5) + speechlike(SR * 3, seed=2) * 0.5
    offline = filtered.enhance(torch.from_numpy(x)[None])[0].numpy()
    plain = copy.deepcopy(filtered)
    plain.config = dataclasses.replace(filtered.config, pitch_filter=0.0)
    assert_differs(offline, plain.enhance(torch.from_numpy(x)[None])[0].numpy())  # the filter acts
    assert_close_to_peak(torch_streaming(filtered, x), offline)  # the torch step, hop by hop
    assert_close_to_peak(torch_streaming(filtered, x, chunks=[5, 1, 17, 200]), offline)  # and in chunks
    assert_close_to_peak(stream_through(filtered_rt.stream(), x, random_chunks(len(x), rng)), offline)
    assert_close_to_peak(filtered_rt.enhance(x, SR), offline)


def test_lanes_keep_their_own_state(filtered, filtered_rt):
    """Two voices batched in one pool, one started later: each gets its own offline output."""
    assert_lanes_match_offline(filtered, filtered_rt, voiced(SR, 120.0, seed=1, snr_db=5),
                               voiced(SR, 230.0, seed=2, snr_db=0) * 0.3)


def test_export_command_sets_the_filter(torch_model, tmp_path, capsys):
    check_export_flag(torch_model, tmp_path, capsys, "--pitch-filter", 0.5, 5, "pitch_filter")


def _walk(graph):
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.g is not None and len(a.g.node):
                yield from _walk(a.g)


def test_8bit_export_keeps_the_filter_in_float(filtered, torch_model, tmp_path):
    """`--int8` quantizes the network's dense layers, not the filter's DFT, band or correlation
    matrices: as many 8-bit matmuls as the same model without the filter, and every pitch constant
    read by a float MatMul."""
    import onnx

    from enhancer.build.export import export_step

    def exported(model, name):
        export_step(model, tmp_path / name, check=False, int8_weights=True)
        return list(_walk(onnx.load(str(tmp_path / name)).graph))

    with_filter, without = exported(filtered, "pf.onnx"), exported(torch_model, "plain.onnx")
    count = lambda nodes: sum(n.op_type in ("MatMulNBits", "MatMulInteger", "MatMulIntegerToFloat") for n in nodes)  # noqa: E731
    assert count(with_filter) == count(without) > 0
    pitch_inputs = {i for n in with_filter for i in n.input if i.startswith("pitch_corr") or i.startswith("pitch_interp")}
    assert {"pitch_corr_c1", "pitch_corr_c4", "pitch_interp"} <= pitch_inputs
