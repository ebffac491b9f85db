"""The training objective's loss floor: log(|S| + floor) on both sides, exact against numpy, and
quiet bins stop dominating the error."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from training.objective import floored_estimate, refloor, weighted_mse

EPS = 1e-4


def test_floored_loss_matches_numpy():
    rng = np.random.default_rng(0)
    noisy, clean = rng.uniform(0, 2, (2, 5, 7)), rng.uniform(0, 2, (2, 5, 7))
    gains, w = rng.uniform(0, 1, (2, 5, 7)), (rng.uniform(0, 1, (2, 1, 7)) > 0.3).astype(float)
    floor = 1e-2
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    got = weighted_mse(floored_estimate(t(np.log(noisy + EPS)), t(gains), EPS, floor),
                       refloor(t(np.log(clean + EPS)), EPS, floor), t(w).expand(2, 5, 7))
    want = (((np.log(gains * noisy + floor) - np.log(clean + floor)) ** 2) * w).sum() / np.broadcast_to(w, noisy.shape).sum()
    assert float(got) == pytest.approx(want, rel=1e-12)
    assert torch.allclose(refloor(t(np.log(clean + EPS)), EPS, EPS), t(np.log(clean + EPS)))


def test_a_larger_floor_discounts_inaudible_bins():
    # two bins: a loud one estimated 1 dB off, a very quiet one (clean 1e-5) estimated 20 dB too loud
    noisy = torch.tensor([[[1.0, 1e-3]]])
    clean = torch.tensor([[[1.0, 1e-5]]])
    gains = torch.tensor([[[10 ** (-1 / 20), 1e-1]]])
    w = torch.ones(1, 1, 2)
    per_bin = lambda floor: (floored_estimate(torch.log(noisy + EPS), gains, EPS, floor)  # noqa: E731
                             - refloor(torch.log(clean + EPS), EPS, floor)) ** 2
    tiny, large = per_bin(EPS)[0, 0], per_bin(1e-2)[0, 0]
    assert tiny[1] > 10 * tiny[0]  # with the feature epsilon the inaudible bin dominates
    assert large[1] < 0.1 * large[0]  # with a 1e-2 floor the audible error does
    assert float(weighted_mse(per_bin(1e-2) ** 0.5, torch.zeros(1, 1, 2), w)) < float(weighted_mse(per_bin(EPS) ** 0.5, torch.zeros(1, 1, 2), w))
