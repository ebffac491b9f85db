"""The shipping rule (`enhancer-train compare`): paired intervals of PESQ-WB + DNSMOS OVRL, neither traded away."""
import csv

import numpy as np
import pytest

from training.cli import main
from training.data.manifests import DataError
from training.evaluation.decide import TIE, decide, paired, read_eval

KEYS = ("pesq_wb", "stoi", "si_sdr", "dnsmos_sig", "dnsmos_bak", "dnsmos_ovrl")


def write_eval(folder, scores: dict[str, dict[str, float]], dnsmos: bool = True):
    folder.mkdir(parents=True)
    keys = [k for k in KEYS if dnsmos or not k.startswith("dnsmos")] + (["speech_level"] if "speech_level" in next(iter(scores.values())) else [])
    with open(folder / "per_file.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["name", "seconds"] + [f"{t}_{k}" for k in keys for t in ("noisy", "enhanced")])
        for name, s in scores.items():
            w.writerow([name, "8.000"] + [f"{v:.4f}" for k in keys for v in (1.0, s[k])])
    return folder


def population(n=60, seed=0, pesq=0.0, ovrl=0.0, noise=0.02):
    rng = np.random.default_rng(seed)
    base = {f"f{i:03d}.wav": {"pesq_wb": 2.0 + 0.5 * rng.random(), "stoi": 0.8, "si_sdr": 10.0, "dnsmos_sig": 3.2,
                              "dnsmos_bak": 3.5, "dnsmos_ovrl": 2.6 + 0.3 * rng.random()} for i in range(n)}
    cand = {k: {**v, "pesq_wb": v["pesq_wb"] + pesq + noise * rng.standard_normal(),
                "dnsmos_ovrl": v["dnsmos_ovrl"] + ovrl + noise * rng.standard_normal()} for k, v in base.items()}
    return base, cand


def test_a_candidate_better_on_both_ships(tmp_path):
    ref, cand = population(pesq=0.02, ovrl=0.05)
    d = decide(read_eval(write_eval(tmp_path / "r", ref)), read_eval(write_eval(tmp_path / "c", cand)))
    assert d.ship and not d.reasons
    mean, low, high, files = d.differences["quality"]
    assert files == 60 and low > 0 and low < mean < high
    assert mean == pytest.approx(np.mean([cand[k]["pesq_wb"] + cand[k]["dnsmos_ovrl"] - ref[k]["pesq_wb"]
                                          - ref[k]["dnsmos_ovrl"] for k in ref]), abs=1e-3)


def test_more_pesq_bought_with_residual_noise_does_not_ship(tmp_path):
    ref, cand = population(pesq=0.10, ovrl=-0.03)  # the sum rises, OVRL falls
    d = decide(read_eval(write_eval(tmp_path / "r", ref)), read_eval(write_eval(tmp_path / "c", cand)))
    assert d.differences["quality"][1] > 0 and d.differences["dnsmos_ovrl"][0] < -TIE
    assert not d.ship and any("DNSMOS OVRL falls" in r for r in d.reasons)


def test_a_difference_within_noise_does_not_ship_and_the_command_says_so(tmp_path, capsys):
    ref, cand = population(pesq=0.0, ovrl=0.0, noise=0.05)
    r, c = write_eval(tmp_path / "r", ref), write_eval(tmp_path / "c", cand)
    assert main(["compare", "--reference", str(r), "--candidate", str(c)]) == 1
    out = capsys.readouterr().out
    assert "| PESQ-WB + OVRL |" in out and "| DNSMOS BAK |" in out and "does not ship" in out


def test_paired_interval_is_a_bootstrap_over_files():
    ref = {f"{i}": {"m": 0.0} for i in range(200)}
    cand = {f"{i}": {"m": 1.0 if i % 2 else 0.0} for i in range(200)}
    mean, low, high, n = paired(ref, cand, "m")
    assert n == 200 and mean == pytest.approx(0.5) and low < 0.5 < high and high - low < 0.3


def test_reports_without_dnsmos_are_refused(tmp_path):
    ref, _ = population()
    with pytest.raises(DataError, match="DNSMOS"):
        read_eval(write_eval(tmp_path / "r", ref, dnsmos=False))


def test_the_speech_level_is_reported_beside_when_both_reports_carry_it(tmp_path, capsys):
    ref, cand = population(pesq=0.02, ovrl=0.05)
    old_r, old_c = write_eval(tmp_path / "old-r", ref), write_eval(tmp_path / "old-c", cand)  # reports from before it
    for i, k in enumerate(sorted(ref)):
        ref[k]["speech_level"] = -3.0 - 0.01 * i
        cand[k]["speech_level"] = ref[k]["speech_level"] + 1.0
    r, c = write_eval(tmp_path / "r", ref), write_eval(tmp_path / "c", cand)
    d = decide(read_eval(r), read_eval(c))
    assert d.ship and d.differences["speech_level"][:2] == pytest.approx((1.0, 1.0), abs=1e-6)
    assert main(["compare", "--reference", str(r), "--candidate", str(c)]) == 0
    assert "| Speech level (dB) | +1.00 | [+1.00, +1.00] | 60 |" in capsys.readouterr().out
    assert decide(read_eval(old_r), read_eval(old_c)).differences["speech_level"] is None
    assert main(["compare", "--reference", str(old_r), "--candidate", str(old_c)]) == 0
    assert "Speech level" not in capsys.readouterr().out
