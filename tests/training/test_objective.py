"""The training objective: the log-magnitude MSE and the power-law-compressed magnitude term,
checked against a numpy reference built from the model's gains; the waveform terms (SI-SDR and the
multi-resolution STFT loss of the resynthesis) against their definitions."""
from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest
import torch

from enhancer import ModelConfig
from enhancer.build.model import features
from enhancer.config import STFTConfig
from training.losses.objective import (
    COMPRESSED_POWER,
    LossConfig,
    band_weight,
    batch_loss,
    loss_sums,
    mrstft_loss,
    resynthesise,
    si_sdr,
)


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(3)
    n = 8000
    t = torch.arange(n) / 16000
    clean = 0.2 * torch.sin(2 * np.pi * 220 * t) * torch.ones(2, 1)
    noisy = clean + 0.05 * torch.randn(2, n, generator=g)
    bandwidth = torch.tensor([8000.0, 4000.0])
    return noisy, clean, bandwidth


def reference_terms(model, noisy, clean, bandwidth, floor, over=1.0):
    """(log-magnitude MSE, compressed MSE) in float64 numpy from the model's own gains; the errors of
    bins where the estimate exceeds the clean magnitude weighted by `over` (the mean is over bins)."""
    cfg = model.config
    xs = features.stft(noisy, cfg.stft).abs()
    ys = features.stft(clean, cfg.stft).abs()
    with torch.no_grad():
        gains, _ = model(torch.log(xs + cfg.log_eps), pad_end=False)
    t = gains.shape[1]
    g, x, y = (a.double().numpy() for a in (gains, xs[:, :t], ys[:, :t]))
    freqs = np.arange(cfg.n_freqs) * cfg.stft.sample_rate / cfg.stft.n_fft
    w = np.broadcast_to((freqs[None, :] <= bandwidth.numpy()[:, None] + 1e-3)[:, None, :], g.shape).astype(float)
    est = g * x
    log_err = (np.log(est + floor) - np.log(y + floor)) ** 2
    comp_err = (np.maximum(est, 1e-6) ** COMPRESSED_POWER - np.maximum(y, 1e-6) ** COMPRESSED_POWER) ** 2
    wo = w * np.where(est > y, over, 1.0)
    return (log_err * wo).sum() / w.sum(), (comp_err * wo).sum() / w.sum()


def test_log_and_compressed_terms_match_the_reference(tiny_model, batch):
    noisy, clean, bw = batch
    log_ref, comp_ref = reference_terms(tiny_model, noisy, clean, bw, 1e-2)
    with torch.no_grad():
        plain = float(batch_loss(tiny_model, tiny_model, noisy, clean, bw, nullcontext, 1e-2))
        mixed = float(batch_loss(tiny_model, tiny_model, noisy, clean, bw, nullcontext, 1e-2, compressed_weight=5.0))
    assert plain == pytest.approx(log_ref, rel=1e-3)
    assert comp_ref > 1e-3 * log_ref  # the term is not negligible on this input
    assert mixed - plain == pytest.approx(5.0 * comp_ref, rel=1e-3)


def test_overestimate_weight_scales_the_errors_of_noise_left_in(tiny_model, batch):
    noisy, clean, bw = batch
    log_ref, comp_ref = reference_terms(tiny_model, noisy, clean, bw, 1e-2, over=3.0)
    log_sym, comp_sym = reference_terms(tiny_model, noisy, clean, bw, 1e-2)
    assert log_ref > 1.05 * log_sym and comp_ref > 1.05 * comp_sym  # the input has bins on both sides
    with torch.no_grad():
        got = float(batch_loss(tiny_model, tiny_model, noisy, clean, bw, nullcontext, 1e-2, compressed_weight=5.0,
                               overestimate_weight=3.0))
        same = float(batch_loss(tiny_model, tiny_model, noisy, clean, bw, nullcontext, 1e-2, compressed_weight=5.0,
                                overestimate_weight=1.0))
    assert got == pytest.approx(log_ref + 5.0 * comp_ref, rel=1e-3)
    assert same == pytest.approx(log_sym + 5.0 * comp_sym, rel=1e-3)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="overestimate_weight"):
            batch_loss(tiny_model, tiny_model, noisy, clean, bw, nullcontext, 1e-2, overestimate_weight=bad)


def residual_reference(model, noisy, clean, bandwidth):
    """The residual term in float64 numpy: the compressed squared error over bins where the noise
    (noisy - clean, complex) is louder than the speech and the estimate exceeds the clean magnitude."""
    cfg = model.config
    xs, ys = features.stft(noisy, cfg.stft), features.stft(clean, cfg.stft)
    with torch.no_grad():
        gains, _ = model(torch.log(xs.abs() + cfg.log_eps), pad_end=False)
    t = gains.shape[1]
    g = gains.double().numpy()
    x, y = xs[:, :t].numpy().astype(np.complex128), ys[:, :t].numpy().astype(np.complex128)
    freqs = np.arange(cfg.n_freqs) * cfg.stft.sample_rate / cfg.stft.n_fft
    w = np.broadcast_to((freqs[None, :] <= bandwidth.numpy()[:, None] + 1e-3)[:, None, :], g.shape).astype(float)
    est, ref = g * np.abs(x), np.abs(y)
    err = (np.maximum(est, 1e-6) ** COMPRESSED_POWER - np.maximum(ref, 1e-6) ** COMPRESSED_POWER) ** 2
    mask = (np.abs(x - y) > ref) & (est > ref)
    return (err * w * mask).sum() / w.sum(), mask.mean()


def test_residual_weight_adds_the_noise_left_in_noise_dominated_bins(tiny_model, batch):
    noisy, clean, bw = batch
    ref, share = residual_reference(tiny_model, noisy, clean, bw)
    assert 0.05 < share < 0.99 and ref > 0  # the input has such bins, and others (the tone's)
    with torch.no_grad():
        plain = float(batch_loss(tiny_model, tiny_model, noisy, clean, bw, nullcontext, 1e-2, compressed_weight=5.0))
        got = float(batch_loss(tiny_model, tiny_model, noisy, clean, bw, nullcontext, 1e-2, compressed_weight=5.0,
                               residual_weight=7.0))
        alone = float(batch_loss(tiny_model, tiny_model, noisy, clean, bw, nullcontext, 1e-2, residual_weight=7.0))
        log_only = float(batch_loss(tiny_model, tiny_model, noisy, clean, bw, nullcontext, 1e-2))
    assert got - plain == pytest.approx(7.0 * ref, rel=1e-3)
    assert alone - log_only == pytest.approx(7.0 * ref, rel=1e-3)  # without the compressed term too
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="residual_weight"):
            batch_loss(tiny_model, tiny_model, noisy, clean, bw, nullcontext, 1e-2, residual_weight=bad)


def teacher_of(model, window: int):
    """A model with `model`'s weights and framing and another attention window (as a teacher or a student)."""
    from dataclasses import replace

    from enhancer import build_model

    other = build_model(replace(model.config, attention_window=window)).eval()
    other.load_state_dict(model.state_dict())
    return other


def teacher_reference(student, teacher, noisy, bandwidth, floor):
    """The teacher term in float64 numpy: the log-magnitude squared error of the student's estimate
    against the teacher's, over the bins compared, per bin compared."""
    cfg = student.config
    xs = features.stft(noisy, cfg.stft).abs()
    with torch.no_grad():
        gs, _ = student(torch.log(xs + cfg.log_eps), pad_end=False)
        gt, _ = teacher(torch.log(xs + cfg.log_eps), pad_end=False)
    t = gs.shape[1]
    x = xs[:, :t].double().numpy()
    freqs = np.arange(cfg.n_freqs) * cfg.stft.sample_rate / cfg.stft.n_fft
    w = np.broadcast_to((freqs[None, :] <= bandwidth.numpy()[:, None] + 1e-3)[:, None, :], x.shape).astype(float)
    err = (np.log(gs.double().numpy() * x + floor) - np.log(gt.double().numpy() * x + floor)) ** 2
    return (err * w).sum() / w.sum()


def test_teacher_term_is_the_log_magnitude_error_against_the_teacher(tiny_model, batch):
    noisy, clean, bw = batch
    student = teacher_of(tiny_model, 4)  # the same weights, a quarter of the window
    ref = teacher_reference(student, tiny_model, noisy, bw, 1e-2)
    assert ref > 0  # the shorter window changes the estimate
    with torch.no_grad():
        plain = float(batch_loss(student, student, noisy, clean, bw, nullcontext, 1e-2, compressed_weight=5.0))
        config = LossConfig(loss_floor=1e-2, compressed_weight=5.0, teacher_weight=3.0)
        got = float(config(student, student, noisy, clean, bw, nullcontext, tiny_model))
        itself = float(config(tiny_model, tiny_model, noisy, clean, bw, nullcontext, tiny_model))
        itself_plain = float(batch_loss(tiny_model, tiny_model, noisy, clean, bw, nullcontext, 1e-2, compressed_weight=5.0))
    assert got - plain == pytest.approx(3.0 * ref, rel=1e-3)
    assert itself == pytest.approx(itself_plain, rel=1e-6)  # a model is its own teacher: the term is 0
    with pytest.raises(ValueError, match="needs a teacher"):
        config(student, student, noisy, clean, bw, nullcontext)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="teacher_weight"):
            LossConfig(teacher_weight=bad)


def test_teacher_term_trains_the_student_only(tiny_model, batch):
    noisy, clean, bw = batch
    student, teacher = teacher_of(tiny_model, 4).train(), teacher_of(tiny_model, 16)
    for p in teacher.parameters():
        p.requires_grad_(False)
    loss = LossConfig(loss_floor=1e-2, teacher_weight=10.0)(student, student, noisy, clean, bw, nullcontext, teacher)
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    grads = [p.grad for p in student.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().max() > 0 for g in grads)


def test_load_teacher_checks_the_framing_and_the_weight(tiny_model, tmp_path):
    from dataclasses import replace
    from pathlib import Path

    from enhancer import build_model, save_checkpoint
    from training.options import FitOptions
    from training.prepare import load_teacher

    cfg = tiny_model.config
    path = save_checkpoint(tiny_model, cfg, tmp_path / "teacher.pt")
    student_cfg = replace(cfg, attention_window=4)
    opts = FitOptions(out=Path(tmp_path / "run"), teacher=str(path), teacher_weight=2.0)
    teacher = load_teacher(opts, student_cfg, torch.device("cpu"), lambda *_: None)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert teacher.config.attention_window == cfg.attention_window
    other = build_model(replace(cfg, lookahead=cfg.lookahead + 1))
    other_path = save_checkpoint(other, other.config, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="lookahead"):
        load_teacher(FitOptions(out=Path(tmp_path), teacher=str(other_path), teacher_weight=1.0), student_cfg,
                     torch.device("cpu"), lambda *_: None)
    with pytest.raises(ValueError, match="--teacher-weight needs --teacher"):
        load_teacher(FitOptions(out=Path(tmp_path), teacher_weight=1.0), student_cfg, torch.device("cpu"), print)
    with pytest.raises(ValueError, match="give it a weight"):
        load_teacher(FitOptions(out=Path(tmp_path), teacher=str(path)), student_cfg, torch.device("cpu"), print)
    assert load_teacher(FitOptions(out=Path(tmp_path)), student_cfg, torch.device("cpu"), print) is None


def test_compressed_term_has_finite_gradients_at_silent_bins(tiny_model, batch):
    noisy, _, bw = batch
    clean = torch.zeros_like(noisy)  # |S| = 0 everywhere: the floor keeps d|x|^0.3 finite
    model = tiny_model.train()
    try:
        model.zero_grad()
        loss = batch_loss(model, model, noisy, clean, bw, nullcontext, 1e-2, compressed_weight=20.0)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
    finally:
        model.zero_grad()
        model.eval()


# --------------------------------------------------------------------------- waveform terms
def test_si_sdr_matches_its_definition():
    g = torch.Generator().manual_seed(5)
    ref = torch.randn(3, 4000, generator=g, dtype=torch.float64)
    noise = torch.randn(3, 4000, generator=g, dtype=torch.float64)
    noise = noise - (noise * ref).sum(-1, keepdim=True) / (ref * ref).sum(-1, keepdim=True) * ref  # orthogonal to ref
    scale = torch.tensor([[0.5], [2.0], [7.0]], dtype=torch.float64)
    for snr in (-5.0, 0.0, 20.0):
        gain = (ref.pow(2).sum(-1) / noise.pow(2).sum(-1) / 10 ** (snr / 10)).sqrt()[:, None]
        got = si_sdr(ref, scale * (ref + gain * noise))  # the scale of the estimate does not matter
        assert torch.allclose(got, torch.full((3,), snr, dtype=torch.float64), rtol=1e-6, atol=1e-6 * 20)


def test_resynthesis_of_unit_gains_on_clean_input_is_the_clean_waveform(batch):
    _, clean, _bw = batch
    cfg = STFTConfig()
    spec = features.stft(clean, cfg)
    w = band_weight(torch.tensor([8000.0, 8000.0]), ModelConfig()).expand(-1, spec.shape[1], -1)
    est, ref = resynthesise(spec, spec, w, cfg)
    n = (spec.shape[1] - 1) * cfg.hop
    assert est.shape == (2, n)
    padded = torch.nn.functional.pad(clean, (0, max(0, n - clean.shape[1])))[:, :n]  # the STFT pads the end
    err = float((ref - padded).pow(2).sum() / padded.pow(2).sum())
    assert err < 1e-10  # perfect reconstruction of the runtime's framing
    assert float(mrstft_loss(est, ref).abs().max()) < 1e-4 * float(mrstft_loss(0.5 * est, ref).min())


def test_waveform_terms_add_their_weighted_means_and_reach_the_model(tiny_model, batch):
    noisy, clean, bw = batch
    with torch.no_grad():
        plain = float(batch_loss(tiny_model, tiny_model, noisy, clean, bw, nullcontext, 1e-2))
        sums = loss_sums(tiny_model, tiny_model, noisy, clean, bw, nullcontext, 1e-2, None, (True, True))
        both = float(batch_loss(tiny_model, tiny_model, noisy, clean, bw, nullcontext, 1e-2,
                                sisdr_weight=0.01, mrstft_weight=0.2))
    assert sums.examples == 2 and sums.neg_sisdr is not None and sums.mrstft is not None
    expected = 0.01 * float(sums.neg_sisdr) / 2 + 0.2 * float(sums.mrstft) / 2
    assert both - plain == pytest.approx(expected, rel=1e-4)
    model = tiny_model.train()
    try:
        for kw in ({"sisdr_weight": 1.0}, {"mrstft_weight": 1.0}):
            model.zero_grad()
            batch_loss(model, model, noisy, clean, bw, nullcontext, 1e-2, **kw).backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            assert grads and all(torch.isfinite(g).all() for g in grads)
            assert sum(float(g.abs().sum()) for g in grads) > 0
    finally:
        model.zero_grad()
        model.eval()


def with_pitch_filter(model, strength: float = 0.7, exponent: float = 1.25):
    """`model`'s weights in a model whose config has a pitch filter and a gain exponent."""
    import dataclasses

    from enhancer import build_model

    cfg = dataclasses.replace(model.config, pitch_filter=strength, gain_exponent=exponent)
    out = build_model(cfg).eval()
    out.load_state_dict(model.state_dict())
    return out


@pytest.fixture(scope="module")
def voiced():
    """A 200 Hz voice-like harmonic tone in white noise at about 5 dB, 0.6 s."""
    g = torch.Generator().manual_seed(5)
    n = 9600
    t = torch.arange(n) / 16000
    clean = sum(0.1 / k * torch.sin(2 * np.pi * 200 * k * t + k) for k in range(1, 16)) * torch.ones(1, 1)
    noisy = clean + 0.04 * torch.randn(1, n, generator=g)
    return noisy, clean, torch.tensor([8000.0])


def test_pitch_filter_loss_compares_the_gains_on_the_filtered_spectrum(tiny_model, voiced):
    from enhancer.build.model import pitchfilter

    model = with_pitch_filter(tiny_model)
    cfg = model.config
    noisy, clean, bw = voiced
    spec, ys = features.stft(noisy, cfg.stft), features.stft(clean, cfg.stft).abs()
    with torch.no_grad():
        gains, _ = model(torch.log(spec.abs() + cfg.log_eps), pad_end=False)
        t = gains.shape[1]
        filtered = pitchfilter.filter_offline(cfg, noisy, spec[:, :t], gains ** 1.25)
    est, plain, y = (a.double().numpy() for a in (gains * filtered.abs(), gains * spec[:, :t].abs(), ys[:, :t]))
    expected = ((np.log(est + 1e-2) - np.log(y + 1e-2)) ** 2).mean()
    without = ((np.log(plain + 1e-2) - np.log(y + 1e-2)) ** 2).mean()
    with torch.no_grad():
        on = float(LossConfig(loss_floor=1e-2, pitch_filter_loss=True)(model, model, noisy, clean, bw, nullcontext))
        off = float(LossConfig(loss_floor=1e-2)(model, model, noisy, clean, bw, nullcontext))
    assert on == pytest.approx(expected, rel=1e-5)
    assert off == pytest.approx(without, rel=1e-5)
    assert abs(on - off) > 1e-2 * off  # the filter acts on this voiced input
    with torch.no_grad():  # a teacher's gains apply to the same filtered spectrum: itself as teacher adds 0
        taught = float(LossConfig(loss_floor=1e-2, teacher_weight=1.0, pitch_filter_loss=True)(
            model, model, noisy, clean, bw, nullcontext, teacher=model))
    assert taught == pytest.approx(on, rel=1e-6)


def test_pitch_filter_loss_trains_the_gains_through_the_filtered_spectrum(tiny_model, voiced):
    model = with_pitch_filter(tiny_model)
    noisy, clean, bw = voiced
    model.zero_grad()
    LossConfig(loss_floor=1e-2, compressed_weight=20.0, sisdr_weight=0.01,
               pitch_filter_loss=True)(model, model, noisy, clean, bw, nullcontext).backward()
    grad = model.head.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and float(grad.abs().max()) > 0.0


def test_pitch_filter_loss_needs_a_model_with_a_pitch_filter(tiny_model, voiced):
    noisy, clean, bw = voiced
    assert tiny_model.config.pitch_filter == 0
    with pytest.raises(ValueError, match="pitch filter"):
        LossConfig(pitch_filter_loss=True)(tiny_model, tiny_model, noisy, clean, bw, nullcontext)
