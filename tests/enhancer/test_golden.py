"""Golden figures of the shipped model on a real Voicebank+DEMAND cut (tests/fixtures/golden/).

A new models/tim.onnx must come with new figures: `python -m tests.golden_update`.
"""
from __future__ import annotations

import json

import pytest

from tests.golden_update import (
    GOLDEN_JSON,
    PROVIDERS,
    SAMPLE_RATE,
    UPDATE_COMMAND,
    load_pair,
    score,
    sha256,
    shipped_model,
)


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN_JSON.read_text())


def check_model_hash(golden: dict) -> None:
    got = sha256(shipped_model())
    if got != golden["model_sha256"]:
        pytest.fail(f"{shipped_model()} (sha256 {got[:12]}) is not the model of {GOLDEN_JSON.name} "
                    f"(sha256 {golden['model_sha256'][:12]}): run `{UPDATE_COMMAND}` and commit the new figures",
                    pytrace=False)


def test_golden_figures_belong_to_the_shipped_model(golden):
    check_model_hash(golden)


def test_golden_figures(golden):
    pytest.importorskip("pesq")
    from enhancer.runtime import Enhancer

    check_model_hash(golden)
    enh = Enhancer.from_pretrained(providers=PROVIDERS)
    assert enh.engine.path.resolve() == shipped_model().resolve()
    noisy, clean = load_pair()
    enhanced = enh.enhance(noisy, SAMPLE_RATE)
    assert enhanced.shape == noisy.shape

    got = {"noisy": score(clean, noisy), "enhanced": score(clean, enhanced)}
    tol = golden["tolerance"]
    errors = [f"{tag} {k}: {got[tag][k]:.4f}, golden {golden[tag][k]:.4f} +- {tol[k]}"
              for tag in ("noisy", "enhanced") for k in ("pesq_wb", "si_sdr")
              if not abs(got[tag][k] - golden[tag][k]) <= tol[k]]
    assert not errors, "; ".join(errors)
    assert got["enhanced"]["pesq_wb"] > got["noisy"]["pesq_wb"]
