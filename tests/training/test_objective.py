"""The training objective: the log-magnitude MSE and the power-law-compressed magnitude term,
checked against a numpy reference built from the model's gains."""
from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest
import torch

from enhancer.model import features
from training.objective import COMPRESSED_POWER, batch_loss


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(3)
    n = 8000
    t = torch.arange(n) / 16000
    clean = 0.2 * torch.sin(2 * np.pi * 220 * t) * torch.ones(2, 1)
    noisy = clean + 0.05 * torch.randn(2, n, generator=g)
    bandwidth = torch.tensor([8000.0, 4000.0])
    return noisy, clean, bandwidth


def reference_terms(model, noisy, clean, bandwidth, floor):
    """(log-magnitude MSE, compressed MSE) in float64 numpy from the model's own gains."""
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
    return (log_err * w).sum() / w.sum(), (comp_err * w).sum() / w.sum()


def test_log_and_compressed_terms_match_the_reference(tiny_model, batch):
    noisy, clean, bw = batch
    log_ref, comp_ref = reference_terms(tiny_model, noisy, clean, bw, 1e-2)
    with torch.no_grad():
        plain = float(batch_loss(tiny_model, tiny_model, noisy, clean, bw, nullcontext, 1e-2))
        mixed = float(batch_loss(tiny_model, tiny_model, noisy, clean, bw, nullcontext, 1e-2, compressed_weight=5.0))
    assert plain == pytest.approx(log_ref, rel=1e-3)
    assert comp_ref > 1e-3 * log_ref  # the term is not negligible on this input
    assert mixed - plain == pytest.approx(5.0 * comp_ref, rel=1e-3)


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
