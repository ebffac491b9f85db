"""The differentiable P.862 model (`training.losses.perceptual`) against the reference PESQ-WB (the `pesq`
package, ITU-T P.862.2's C code) on a real speech pair, its invariances and its gradient, and the
`--pesq-weight` term of the training objective."""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from enhancer.build.model import features
from enhancer.config import STFTConfig
from training.losses.objective import batch_loss, loss_sums, pesq_model
from training.losses.perceptual import PesqModel, aggregate

pesq = pytest.importorskip("pesq")
GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden"


@pytest.fixture(scope="module")
def pair():
    clean, sr = sf.read(GOLDEN / "clean.flac", dtype="float32")
    noisy, _ = sf.read(GOLDEN / "noisy.flac", dtype="float32")
    assert sr == 16000
    return clean, noisy - clean


def mag(x: np.ndarray) -> torch.Tensor:
    return features.stft(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))[None]).abs()


def test_mos_tracks_reference_pesq(pair):
    """Speech plus its own real noise at six levels: within 0.1 MOS of P.862.2 at every level, in
    the same order (the model leaves out only time alignment and the recursive gain smoothing)."""
    clean, noise = pair
    model = pesq_model(STFTConfig(), "cpu", compensate=True)
    ref, got = [], []
    for g in (3.0, 1.0, 0.5, 0.25, 0.1, 0.03):
        deg = clean + g * noise
        ref.append(pesq.pesq(16000, clean, deg, "wb"))
        got.append(model.mos(mag(deg), mag(clean)).item())
    ref, got = np.array(ref), np.array(got)
    assert np.all(np.diff(ref) > 0) and np.all(np.diff(got) > 0), (ref, got)
    assert np.max(np.abs(got - ref)) < 0.1, (ref, got)
    assert got[0] < 1.2 and got[-1] > 3.4


def test_identical_signals_and_level(pair):
    """An estimate equal to the clean speech scores P.862.2's ceiling (4.644). With the standard's
    compensation any level does (each signal is aligned on its own); the training term puts the
    estimate on the clean speech's alignment, so a level change costs (more the larger it is)."""
    clean, _ = pair
    model = pesq_model(STFTConfig(), "cpu", compensate=True)
    strict = pesq_model(STFTConfig(), "cpu")
    assert strict.loss(mag(clean), mag(clean)).item() < 1e-4
    costs = []
    for gain in (1.0, 0.25, 4.0):
        assert model.mos(mag(gain * clean), mag(clean)).item() == pytest.approx(4.644, abs=2e-3)
        assert model.loss(mag(gain * clean), mag(clean)).item() < 1e-4
    for gain in (0.7, 0.25, 0.1):
        costs.append(strict.loss(mag(gain * clean), mag(clean)).item())
    assert 0.0 < costs[0] < costs[1] < costs[2], costs


def test_training_term_charges_colouring(pair):
    """Speech attenuated by 7 dB between 1 and 4 kHz, or by 15 dB below 250 Hz: P.862's frequency
    compensation forgives it (under 0.1 raw-score points), the training term does not (over 0.5)."""
    clean, _ = pair
    model = pesq_model(STFTConfig(), "cpu", compensate=True)
    strict = pesq_model(STFTConfig(), "cpu")
    bins = torch.arange(257)
    for factor in (torch.where((bins > 32) & (bins < 128), 0.45, 1.0), torch.where(bins < 8, 0.18, 1.0)):
        est, ref = mag(clean) * factor, mag(clean)
        assert model.loss(est, ref).item() < 0.1
        assert strict.loss(est, ref).item() > 0.5


def test_band_removed_costs_quality(pair):
    """Zeroing the bins above 4 kHz of a clean estimate lowers the score (the model sees the band)."""
    clean, _ = pair
    model = pesq_model(STFTConfig(), "cpu", compensate=True)
    est = mag(clean)
    est[..., 128:] = 0.0
    mos = model.mos(est, mag(clean)).item()
    assert 2.5 < mos < 4.2
    assert pesq.pesq(16000, clean, clean, "wb") - mos > 0.4


def test_gradient_points_at_less_noise(pair):
    """The gradient of the loss with respect to a gain on the noisy magnitudes is finite, and a step
    along it (less gain where there is noise) lowers the loss."""
    clean, noise = pair
    model = pesq_model(STFTConfig(), "cpu")
    noisy_mag, clean_mag = mag(clean + noise), mag(clean)
    gain = torch.ones_like(noisy_mag, requires_grad=True)
    loss = model.loss(gain * noisy_mag, clean_mag).sum()
    loss.backward()
    grad = gain.grad
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    with torch.no_grad():
        stepped = (gain - 0.05 * grad / grad.abs().max()).clamp(0.0, 1.0)
        assert model.loss(stepped * noisy_mag, clean_mag).item() < loss.item()


def test_aggregate_norms():
    """L6 over 20-frame intervals (hop 10), then L2: a constant stays itself; one loud frame weighs
    more than its share (the L6), short inputs use one interval."""
    const = torch.full((2, 100), 3.0)
    assert torch.allclose(aggregate(const), torch.full((2,), 3.0))
    spike = torch.zeros(1, 100)
    spike[0, 45] = 6.0
    assert aggregate(spike).item() > 6.0 * 0.1
    assert torch.allclose(aggregate(torch.full((1, 7), 2.0)), torch.tensor([2.0]))


def test_other_framings_are_refused():
    with pytest.raises(ValueError, match="512-point STFT at 16000 Hz"):
        PesqModel(n_fft=1024)
    with pytest.raises(ValueError, match="512-point STFT at 16000 Hz"):
        PesqModel(sample_rate=8000)


def test_pesq_weight_adds_the_term(tiny_model):
    """batch_loss with pesq_weight w equals the loss without plus w times the mean disturbance that
    loss_sums reports; 0 leaves the loss unchanged."""
    model = tiny_model
    g = torch.Generator().manual_seed(5)
    t = torch.arange(16000) / 16000
    clean = 0.2 * torch.sin(2 * np.pi * 300 * t) * torch.ones(2, 1)
    noisy = clean + 0.05 * torch.randn(2, 16000, generator=g)
    bw = torch.tensor([8000.0, 8000.0])
    base = batch_loss(model, model, noisy, clean, bw, nullcontext, 1e-2, 20.0)
    same = batch_loss(model, model, noisy, clean, bw, nullcontext, 1e-2, 20.0, pesq_weight=0.0)
    with_term = batch_loss(model, model, noisy, clean, bw, nullcontext, 1e-2, 20.0, pesq_weight=0.5)
    sums = loss_sums(model, model, noisy, clean, bw, nullcontext, 1e-2, None, (False, False), 1.0, True)
    term = (sums.pesq / sums.examples).item()
    assert term > 0.1
    assert same.item() == pytest.approx(base.item(), rel=1e-6)
    assert with_term.item() == pytest.approx(base.item() + 0.5 * term, rel=1e-5)
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="pesq_weight"):
            batch_loss(model, model, noisy, clean, bw, nullcontext, 1e-2, pesq_weight=bad)


def test_pesq_compensate_selects_the_standards_score(tiny_model, pair):
    """batch_loss's `pesq_compensate` switches the term to P.862's compensated score: on the golden
    speech halved in level by a stand-in model, the standard's score forgives the level and the
    training term charges it; `fit` passes --pesq-compensate through."""
    from training.cli import build_parser

    class Halve(torch.nn.Module):
        config = tiny_model.config

        def forward(self, x, pad_end=False):
            return torch.full_like(x[:, : x.shape[1] - self.config.lookahead], 0.5), None

    clean_np, _ = pair
    clean = torch.from_numpy(clean_np)[None].repeat(2, 1)
    bw = torch.tensor([8000.0, 8000.0])
    net = Halve()
    parts = {}
    for comp in (False, True):
        sums = loss_sums(net, net, clean, clean, bw, nullcontext, 1e-2, None, (False, False), 1.0, True, comp)
        parts[comp] = (sums.pesq / sums.examples).item()
        total = batch_loss(net, net, clean, clean, bw, nullcontext, 1e-2, pesq_weight=1.0, pesq_compensate=comp)
        base = batch_loss(net, net, clean, clean, bw, nullcontext, 1e-2)
        assert total.item() == pytest.approx(base.item() + parts[comp], rel=1e-5)
    assert parts[True] < 0.02 < parts[False], parts
    args = build_parser().parse_args(["fit", "--data", "d", "--out", "o", "--pesq-weight", "2",
                                      "--pesq-compensate"])
    assert args.pesq_weight == 2.0 and args.pesq_compensate
