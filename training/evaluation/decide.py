"""The rule that decides whether a model replaces the shipped one, and which checkpoint a run keeps.

Listeners judge a denoiser by the speech it keeps and by the noise it leaves, so no decision rests on
PESQ-WB alone. The quality of a model on a dev set is `PESQ-WB + DNSMOS OVRL` (two MOS scales,
weighed equally; OVRL is DNSMOS's overall rating, which falls with residual noise through BAK and
with speech damage through SIG):

- **Checkpoints** (`DevScore.better_than`, the trainer's `best.pt`): higher quality by more than
  `TIE`, with neither PESQ-WB nor OVRL lower by more than `TIE`. Without the DNSMOS models, PESQ-WB
  alone (the trainer says so when it starts).
- **Shipping** (`decide`, `enhancer-train compare`): paired per file against the shipped model's
  eval report, 95 % bootstrap intervals; the candidate ships when the quality difference's interval
  lies above zero and neither PESQ-WB nor OVRL falls on its own (each mean difference >= -`TIE`).
  SIG, BAK, STOI, SI-SDR and the speech level are reported beside it.

DNSMOS is a judge here, never a teacher: nothing trains on its outputs or gradients.
"""
from __future__ import annotations

import argparse
import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data.manifests import DataError
from .metrics import LABELS

TIE = 0.005  # differences smaller than this (PESQ-WB or OVRL, MOS points) are ties
QUALITY = "quality"  # PESQ-WB + DNSMOS OVRL
REPORTED = ("pesq_wb", "dnsmos_ovrl", "dnsmos_sig", "dnsmos_bak", "stoi", "si_sdr", "speech_level")
DECIMALS = {"pesq_wb": 3, "dnsmos_ovrl": 3, "dnsmos_sig": 3, "dnsmos_bak": 3, "stoi": 4, "si_sdr": 2, "speech_level": 2, QUALITY: 3}


def quality(pesq_wb: float, dnsmos_ovrl: float) -> float:
    """The quality the rule ranks by: PESQ-WB + DNSMOS OVRL (NaN when either is)."""
    return pesq_wb + dnsmos_ovrl


def better(pesq: float, ovrl: float, other_pesq: float, other_ovrl: float) -> bool:
    """The checkpoint rule for one pair of dev scores (see the module docstring)."""
    if not math.isfinite(other_pesq):
        return math.isfinite(pesq)
    if not (math.isfinite(ovrl) and math.isfinite(other_ovrl)):
        return pesq > other_pesq + TIE
    return (quality(pesq, ovrl) > quality(other_pesq, other_ovrl) + TIE
            and pesq >= other_pesq - TIE and ovrl >= other_ovrl - TIE)


def read_eval(folder) -> dict[str, dict[str, float]]:
    """file name -> {metric: enhanced score, "quality": ...} from an `enhancer-train eval` report."""
    path = Path(folder) / "per_file.csv"
    if not path.is_file():
        raise DataError(f"{path}: not found (an `enhancer-train eval --out` folder is expected)")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "enhanced_dnsmos_ovrl" not in rows[0]:
        raise DataError(f"{path}: no DNSMOS columns; run eval with the DNSMOS models (--dnsmos DIR)")
    out = {}
    for r in rows:
        scores = {k: float(r[f"enhanced_{k}"]) for k in REPORTED if f"enhanced_{k}" in r}
        scores[QUALITY] = quality(scores["pesq_wb"], scores["dnsmos_ovrl"])
        out[r["name"]] = scores
    return out


def paired(reference: dict, candidate: dict, metric: str, resamples: int = 2000, seed: int = 0):
    """(mean, low, high, files) of candidate - reference over the files both scored (finite scores),
    the interval a 95 % bootstrap over files; None without common files."""
    names = sorted(set(reference) & set(candidate))
    d = np.array([candidate[n][metric] - reference[n][metric] for n in names
                  if math.isfinite(candidate[n].get(metric, math.nan)) and math.isfinite(reference[n].get(metric, math.nan))])
    if not d.size:
        return None
    means = d[np.random.default_rng(seed).integers(0, d.size, (resamples, d.size))].mean(axis=1)
    return float(d.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5)), int(d.size)


@dataclass(frozen=True)
class Decision:
    ship: bool
    differences: dict  # metric -> (mean, low, high, files)
    reasons: tuple[str, ...]  # why not, when not


def decide(reference: dict, candidate: dict, resamples: int = 2000, seed: int = 0) -> Decision:
    """The shipping rule (module docstring) on two `read_eval` results."""
    diffs = {m: paired(reference, candidate, m, resamples, seed) for m in (QUALITY, *REPORTED)}
    if diffs[QUALITY] is None:
        raise DataError("the two reports have no file in common")
    reasons = []
    if diffs[QUALITY][1] <= 0:
        reasons.append(f"PESQ-WB + OVRL {diffs[QUALITY][0]:+.3f}: its interval [{diffs[QUALITY][1]:+.3f}, "
                       f"{diffs[QUALITY][2]:+.3f}] is not above zero")
    for m in ("pesq_wb", "dnsmos_ovrl"):
        if diffs[m][0] < -TIE:
            reasons.append(f"{LABELS[m]} falls by {-diffs[m][0]:.3f}")
    return Decision(not reasons, diffs, tuple(reasons))


def report(decision: Decision) -> str:
    labels = {QUALITY: "PESQ-WB + OVRL", **LABELS}
    lines = ["| metric | candidate - reference | 95 % interval | files |", "|---|---:|---|---:|"]
    for m, d in decision.differences.items():
        if d is not None:
            k = DECIMALS[m]
            lines.append(f"| {labels[m]} | {d[0]:+.{k}f} | [{d[1]:+.{k}f}, {d[2]:+.{k}f}] | {d[3]} |")
    verdict = "ships" if decision.ship else "does not ship: " + "; ".join(decision.reasons)
    return "\n".join(lines) + f"\n\nThe candidate {verdict}.\n"


def add_compare(sub) -> None:
    p = sub.add_parser("compare", help="the shipping rule: a candidate's eval report against the shipped model's",
                       description="Paired per-file differences (95 % bootstrap intervals) of PESQ-WB + DNSMOS OVRL, "
                                   "PESQ-WB, OVRL, SIG, BAK, STOI, SI-SDR and the speech level between two `eval` reports on the same "
                                   "files, and whether the candidate ships: quality interval above zero, neither "
                                   f"PESQ-WB nor OVRL lower by more than {TIE:.3f}.")
    p.add_argument("--reference", type=Path, required=True, help="the shipped model's `eval --out` folder")
    p.add_argument("--candidate", type=Path, required=True, help="the candidate's `eval --out` folder")
    p.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    decision = decide(read_eval(args.reference), read_eval(args.candidate), args.resamples, args.seed)
    print(report(decision), end="")
    return 0 if decision.ship else 1
