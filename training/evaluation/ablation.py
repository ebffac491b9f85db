"""`enhancer-train ablation`: one table of training runs and their dev-set scores.

    enhancer-train ablation --run runs/baseline --eval reports/baseline \\
                            --run runs/tim-nocomp --eval reports/tim-nocomp \\
                            --run runs/tim --eval reports/tim --out ablation.md

For each run (a `fit --out` folder) it reads the preset and model config (config.json), the mixing
settings (train.json), the audio seen and wall time (the last row of metrics.csv), the best
validation loss, and counts the parameters; from the matching `eval --out` report (summary.json)
the noisy and enhanced PESQ-WB, STOI, SI-SDR and DNSMOS OVRL. Runs compared this way should share
data, budget (audio-seconds seen) and scorer; the table shows the budget so that this can be
checked, and warns when the budgets differ by more than 5 %. A second table gives each run's
paired difference from the first run, file by file (per_file.csv), with a 95 % bootstrap
confidence interval: a difference whose interval spans 0 is not one this dev set can tell apart.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from enhancer import ModelConfig

from ..data.manifests import DataError
from .metrics import LABELS

METRICS = tuple((k, LABELS[k], decimals) for k, decimals in (("pesq_wb", 3), ("stoi", 3), ("si_sdr", 2), ("dnsmos_ovrl", 2)))


def run_row(run_dir, eval_dir) -> dict:
    """The figures of one run and its evaluation report."""
    run_dir, eval_dir = Path(run_dir), Path(eval_dir)
    for f in (run_dir / "config.json", run_dir / "train.json", run_dir / "metrics.csv", eval_dir / "summary.json"):
        if not f.is_file():
            raise DataError(f"{f}: not found (give a `fit --out` folder and its `eval --out` report)")
    cfg = ModelConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    train = json.loads((run_dir / "train.json").read_text())
    segment = float(train["mix"]["segment_seconds"])
    last_train, valid = None, []
    with open(run_dir / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row["split"] == "train":
                last_train = row
            elif row["split"] == "valid":
                valid.append((int(row["step"]), float(row["loss"])))
    if last_train is None:
        raise DataError(f"{run_dir / 'metrics.csv'}: no training rows")
    summary = json.loads((eval_dir / "summary.json").read_text())
    best = min(valid, key=lambda x: x[1]) if valid else (None, math.nan)
    return {
        "run": str(run_dir), "preset": cfg.name, "parameters": parameters(cfg), "steps": int(last_train["step"]),
        "audio_hours": int(last_train["examples"]) * segment / 3600, "wall_hours": float(last_train["hours"]),
        "best_valid_loss": best[1], "best_valid_step": best[0], "snr_db": train["mix"].get("snr_db"),
        "files": summary.get("files"), "noisy": summary["noisy"], "enhanced": summary["enhanced"],
    }


def per_file(eval_dir) -> dict[str, dict[str, float]]:
    """name -> {metric: enhanced score} from an eval report's per_file.csv."""
    path = Path(eval_dir) / "per_file.csv"
    if not path.is_file():
        raise DataError(f"{path}: not found")
    with open(path, newline="") as f:
        return {r["name"]: {k: float(r[f"enhanced_{k}"]) for k, _, _ in METRICS if f"enhanced_{k}" in r}
                for r in csv.DictReader(f)}


def paired(reference: dict, other: dict, metric: str, resamples: int = 2000, seed: int = 0):
    """Mean of other - reference over the files both scored, and its 95 % bootstrap interval."""
    import numpy as np

    names = sorted(set(reference) & set(other))
    d = np.array([other[n][metric] - reference[n][metric] for n in names if metric in other[n] and metric in reference[n]])
    if not d.size:
        return None
    idx = np.random.default_rng(seed).integers(0, d.size, (resamples, d.size))
    means = d[idx].mean(axis=1)
    return float(d.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5)), int(d.size)


def difference_table(rows: list[dict], files: list[dict]) -> str:
    ref = rows[0]["preset"]
    head = ["system"] + [f"{m[1]} - `{ref}` [95 % CI]" for m in METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, f in zip(rows[1:], files[1:]):
        cells = []
        for k, _, d in METRICS:
            p = paired(files[0], f, k)
            cells.append("-" if p is None else f"{p[0]:+.{d}f} [{p[1]:+.{d}f}, {p[2]:+.{d}f}]")
        lines.append(f"| `{r['preset']}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parameters(cfg: ModelConfig) -> int:
    from enhancer import build_model
    from enhancer.build.model import count_parameters

    return count_parameters(build_model(cfg))


def table(rows: list[dict]) -> str:
    """Markdown: the noisy input once, then one line per run; the best enhanced score in bold."""
    head = ["system", "parameters", "audio seen (h)", "wall (h)", "best valid loss"] + [m[1] for m in METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    noisy = rows[0]["noisy"]
    lines.append("| noisy input | | | | | " + " | ".join(f"{noisy[k]:.{d}f}" for k, _, d in METRICS) + " |")
    best = {k: max(r["enhanced"][k] for r in rows) for k, _, _ in METRICS}
    for r in rows:
        scores = [f"**{r['enhanced'][k]:.{d}f}**" if r["enhanced"][k] == best[k] and len(rows) > 1
                  else f"{r['enhanced'][k]:.{d}f}" for k, _, d in METRICS]
        lines.append(f"| `{r['preset']}` | {r['parameters']:,} | {r['audio_hours']:.2f} | {r['wall_hours']:.2f} | "
                     f"{r['best_valid_loss']:.4f} | " + " | ".join(scores) + " |")
    return "\n".join(lines) + "\n"


def budget_warning(rows: list[dict]) -> str | None:
    hours = [r["audio_hours"] for r in rows]
    if max(hours) > 1.05 * min(hours):
        return f"warning: the runs saw different amounts of audio ({', '.join(f'{h:.2f} h' for h in hours)})"
    files = {r["files"] for r in rows}
    if len(files) > 1:
        return f"warning: the reports scored different numbers of files ({sorted(files)})"
    return None


def add_ablation(sub) -> None:
    p = sub.add_parser("ablation", help="one table of training runs and their dev-set scores",
                       description=__doc__.split("\n")[0])
    p.add_argument("--run", action="append", required=True, help="a `fit --out` folder (repeat, in table order)")
    p.add_argument("--eval", action="append", required=True, help="its `eval --out` report folder (same order)")
    p.add_argument("--out", help="also write the table (.md) and the figures (.json beside it)")
    p.set_defaults(func=cmd_ablation)


def cmd_ablation(args) -> int:
    if len(args.run) != len(args.eval):
        raise DataError(f"give one --eval per --run ({len(args.run)} runs, {len(args.eval)} reports)")
    rows = [run_row(r, e) for r, e in zip(args.run, args.eval)]
    text = table(rows)
    if len(rows) > 1:
        text += "\n" + difference_table(rows, [per_file(e) for e in args.eval])
    warning = budget_warning(rows)
    print(text, end="")
    if warning:
        print(warning)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + (f"\n{warning}\n" if warning else ""))
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return 0
