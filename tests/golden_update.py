"""Recompute tests/fixtures/golden/golden.json for the current models/tim.onnx and print the figures:

    python -m tests.golden_update

Scores (training.evaluation.metrics, as `enhancer-train eval`) of the noisy fixture and of the shipped model's
output, both against the clean fixture; the tolerances already in golden.json are kept.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from training.data.shards import sha256

UPDATE_COMMAND = "python -m tests.golden_update"
GOLDEN_DIR = Path(__file__).resolve().parent / "fixtures" / "golden"
GOLDEN_JSON = GOLDEN_DIR / "golden.json"
SAMPLE_RATE = 16000
DEFAULT_TOLERANCE = {"pesq_wb": 0.02, "si_sdr": 0.1}
PROVIDERS = ["CPUExecutionProvider"]  # golden figures are CPU figures


def shipped_model() -> Path:
    from enhancer.runtime import DEFAULT_MODEL, MODELS_DIR

    return MODELS_DIR / DEFAULT_MODEL


def load_pair() -> tuple[np.ndarray, np.ndarray]:
    """(noisy, clean) float32 at 16 kHz."""
    import soundfile as sf

    out = []
    for name in ("noisy", "clean"):
        x, sr = sf.read(GOLDEN_DIR / f"{name}.flac", dtype="float32")
        assert sr == SAMPLE_RATE and x.ndim == 1, (name, sr, x.shape)
        out.append(x)
    return out[0], out[1]


def score(clean: np.ndarray, x: np.ndarray) -> dict[str, float]:
    from training.evaluation import metrics

    return {"pesq_wb": metrics.pesq_wb(clean, x, SAMPLE_RATE), "si_sdr": metrics.si_sdr(clean, x)}


def measure() -> dict:
    from enhancer.runtime import Enhancer

    model = shipped_model()
    noisy, clean = load_pair()
    enhanced = Enhancer.from_pretrained(model, providers=PROVIDERS).enhance(noisy, SAMPLE_RATE)
    return {"model_sha256": sha256(model), "noisy": score(clean, noisy), "enhanced": score(clean, enhanced)}


def main() -> int:
    tolerance = DEFAULT_TOLERANCE
    if GOLDEN_JSON.is_file():
        tolerance = json.loads(GOLDEN_JSON.read_text()).get("tolerance", tolerance)
    golden = measure()
    for tag in ("noisy", "enhanced"):
        golden[tag] = {k: round(v, 4) for k, v in golden[tag].items()}
    golden["tolerance"] = tolerance
    GOLDEN_JSON.write_text(json.dumps(golden, indent=2) + "\n")
    print(f"{GOLDEN_JSON}: model {golden['model_sha256'][:12]}")
    for tag in ("noisy", "enhanced"):
        print(f"  {tag:<8} PESQ-WB {golden[tag]['pesq_wb']:.4f}  SI-SDR {golden[tag]['si_sdr']:.4f} dB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
