"""Reports of the peer benchmark: per-file CSV, summary.json, summary.md.

The metrics are the intrusive ones (PESQ-WB, STOI, ESTOI, SI-SDR, the speech level) and, when the run scored them,
DNSMOS SIG / BAK / OVRL, overall, per SNR and per noise kind; the speech level also as the median
file's, overall and per SNR (`speech_level_median`: a few files whose voice is removed pull a mean in
dB far down). Means skip NaN scores (PESQ finds no utterance) and files a peer failed on; the table says when
a peer was scored on fewer files than the others. RTF = enhancement wall time / audio duration,
on one CPU thread (< 1 is faster than real time).
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np

from ..evaluation.devnames import KINDS, kind_of
from ..evaluation.metrics import LABELS
from .score import ALL_METRICS, SCORE_RATE

CSV_COLUMNS = ("peer", "file", "snr", "seconds", "enhance_seconds", "rtf", *ALL_METRICS, "error")
REFERENCE = "noisy"
DNSMOS_TABLES = ("dnsmos_sig", "dnsmos_bak", "dnsmos_ovrl")  # per-SNR and per-kind tables besides PESQ-WB's, when scored


def _scored(values) -> list:
    return [x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]


def _mean(values) -> float:
    v = _scored(values)
    return float(np.mean(v)) if v else math.nan


def _median(values) -> float:
    v = _scored(values)
    return float(np.median(v)) if v else math.nan


def scored_metrics(results: list[dict]) -> tuple[str, ...]:
    """The metrics at least one file of one peer has a number for, in report order."""
    rows = [r for res in results for r in res.get("rows", []) if not r.get("error")]
    return tuple(m for m in ALL_METRICS if any(not math.isnan(_mean([r.get(m)])) for r in rows))


def summarize(results: list[dict], meta: dict | None = None) -> dict:
    """summary.json's content: per peer, its status, means, per-SNR and per-kind means, timing and errors."""
    metrics = scored_metrics(results)

    def _means(rows: list[dict]) -> dict[str, float]:
        out = {m: _mean(r.get(m) for r in rows) for m in metrics}
        if "speech_level" in metrics:
            out["speech_level_median"] = _median(r.get("speech_level") for r in rows)
        return out

    peers = {}
    n_files = max((len(r["rows"]) for r in results), default=0)
    for res in results:
        rows = res.get("rows", [])
        ok = [r for r in rows if not r.get("error")]
        snrs = sorted({r["snr"] for r in ok if r.get("snr") is not None})
        audio = sum(r["seconds"] for r in ok)
        wall = sum(r["enhance_seconds"] for r in ok)
        peers[res["name"]] = {
            **{k: res.get(k) for k in ("status", "reason", "package", "version", "rate", "delay_samples", "settings")},
            "files_scored": len(ok),
            "files_failed": len(rows) - len(ok),
            "errors": [{"file": r["file"], "error": r["error"]} for r in rows if r.get("error")],
            "mean": _means(ok) if ok else {},
            "by_snr": {str(s): {"files": sum(r["snr"] == s for r in ok), **_means([r for r in ok if r["snr"] == s])}
                       for s in snrs},
            "by_kind": {k: {"files": len(rk), **_means(rk)}
                        for k in KINDS if (rk := [r for r in ok if kind_of(r["file"]) == k])},
            "load_seconds": res.get("load_seconds", math.nan),
            "audio_seconds": audio,
            "enhance_seconds": wall,
            "rtf": wall / audio if audio else math.nan,
        }
    return {**(meta or {}), "files": n_files, "score_rate": SCORE_RATE, "metrics": list(metrics),
            "reference": REFERENCE, "peers": peers}


def _fmt(x, digits: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown(summary: dict) -> str:
    peers = summary["peers"]
    ran = {k: v for k, v in peers.items() if v["status"] == "ok" and v["files_scored"]}
    ref = ran.get(REFERENCE, {}).get("mean", {}).get("pesq_wb", math.nan)
    order = sorted(ran, key=lambda k: (k != REFERENCE, -np.nan_to_num(ran[k]["mean"]["pesq_wb"], nan=-9)))
    n = summary["files"]
    metrics = summary["metrics"]
    out = ["# Side-by-side quality benchmark", ""]
    src = f" from `{summary['noisy']}`" if summary.get("noisy") else ""
    judge = ", DNSMOS P.835 SIG / BAK / OVRL" if "dnsmos_ovrl" in metrics else ""
    out += [f"{n} noisy/clean pair(s){src}, every output aligned sample for sample with its input "
            f"(each peer's own delay removed) and scored by one scorer at {SCORE_RATE // 1000} kHz: "
            f"PESQ-WB (ITU-T P.862.2), STOI, ESTOI, SI-SDR, the speech level{judge}. RTF: enhancement time / audio time, "
            "one CPU thread.", ""]
    load, cpus = summary.get("load_average"), summary.get("cpus")
    if load and cpus and max(load) > 0.5 * cpus:
        out += [f"The machine was busy (load average {load[0]:.1f} at the start, {load[1]:.1f} at the end, "
                f"{cpus} CPUs): real-time factors are pessimistic.", ""]
    out += ["| Peer | " + " | ".join(LABELS[m] for m in metrics) + " | Δ PESQ-WB | RTF | Files |",
            "|---|" + "---:|" * (len(metrics) + 3)]
    for k in order:
        p = ran[k]
        d = p["mean"]["pesq_wb"] - ref
        files = f"{p['files_scored']}/{n}" if p["files_scored"] < n else str(n)
        cells = [_fmt(p["mean"][m], 2 if m in ("si_sdr", "speech_level") else 3) for m in metrics]
        out.append(f"| {k} | " + " | ".join(cells) + f" | {'' if k == REFERENCE else _fmt(d, 2)} | "
                   f"{'' if k == REFERENCE else _fmt(p['rtf'], 3)} | {files} |")
    buckets = sorted({int(s) for p in ran.values() for s in p["by_snr"]})
    dnsmos = tuple(t for t in DNSMOS_TABLES if t in metrics)
    tables = [("by_snr", m, f"{LABELS[m]} per SNR bucket", 3) for m in ("pesq_wb", *dnsmos)]
    if "speech_level" in metrics:
        tables.append(("by_snr", "speech_level_median", "Speech level per SNR bucket (the median file, dB)", 2))
    kinds = [k for k in KINDS if any(k in p.get("by_kind", {}) for p in ran.values())]
    tables += [("by_kind", m, f"{LABELS[m]} per noise kind (from the file names)", 3) for m in ("pesq_wb", "stoi", *dnsmos)]
    layouts = {"by_snr": ([str(b) for b in buckets], [f"{b} dB" for b in buckets]), "by_kind": (kinds, kinds)}
    for group, key, title, digits in tables:
        columns, heads = layouts[group]
        if not columns:
            continue
        out += ["", f"## {title}", "", "| Peer | " + " | ".join(heads) + " | all |",
                "|---|" + "---:|" * (len(columns) + 1)]
        for k in order:
            p = ran[k]
            cells = [_fmt(p.get(group, {}).get(c, {}).get(key), digits) for c in columns]
            out.append(f"| {k} | " + " | ".join(cells) + f" | {_fmt(p['mean'].get(key), digits)} |")
        if group == "by_snr" and key == "pesq_wb" and any(
                sum(b["files"] for b in p["by_snr"].values()) < p["files_scored"] for p in ran.values()):
            out += ["", "Files without an SNR in their name (or the manifest) count in \"all\" only."]
    missing = {k: v for k, v in peers.items() if v["status"] != "ok"}
    if missing:
        out += ["", "## Not run", ""] + [f"- {k}: {v['status']}: {v['reason']}" for k, v in missing.items()]
    errors = [(k, e) for k, v in peers.items() for e in v["errors"]]
    if errors:
        out += ["", "## Files that failed", ""] + [f"- {k} on {e['file']}: {e['error']}" for k, e in errors]
    out += ["", "## Peers", "", "| Peer | Package | Native rate | Delay removed | Settings |", "|---|---|---:|---:|---|"]
    for k, v in peers.items():
        pkg = f"{v['package'].split('==')[0]} {v['version']}".strip() if v["package"] else "–"
        delay = f"{v['delay_samples']} ({1000 * v['delay_samples'] / v['rate']:.0f} ms)" if v["delay_samples"] else "0"
        out.append(f"| {k} | {pkg} | {v['rate']} | {delay} | {v['settings']} |")
    return "\n".join(out) + "\n"


def _json_safe(x):
    """NaN -> null, so that summary.json is strict JSON."""
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_reports(results: list[dict], out_dir, meta: dict | None = None) -> dict[str, Path]:
    """per_file.csv, summary.json and summary.md in `out_dir`; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "per_file.csv", "json": out / "summary.json", "md": out / "summary.md"}
    with paths["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for res in results:
            for r in res.get("rows", []):
                secs, wall = r.get("seconds", math.nan), r.get("enhance_seconds", math.nan)
                rtf = wall / secs if secs and not math.isnan(secs) else math.nan
                w.writerow({**r, "snr": "" if r.get("snr") is None else r["snr"], "rtf": rtf})
    summary = summarize(results, meta)
    paths["json"].write_text(json.dumps(_json_safe(summary), indent=2) + "\n")
    paths["md"].write_text(markdown(summary))
    return paths
