"""Noisy/clean file pairs of the peer benchmark, with the SNR of each when known.

Files pair up as in `enhancer-train eval` (`layouts.paired_folders`: same relative path, else the
same `fileid_N`). The SNR comes from a manifest when one is given (CSV, TSV or JSONL with an
`snr` or `snr_db` column and a file column: `file`, `name`, `noisy` or `path`, matched by base
name; the dev set's `manifest.tsv` is one), else from the file name (`snr05_xxx.wav` -> 5 dB with
the default pattern `snr(-?\\d+)`).
"""
from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..data.layouts import paired_folders
from ..data.manifests import DataError

SNR_PATTERN = r"snr(-?\d+)"
FILE_COLUMNS = ("file", "name", "noisy", "path")
SNR_COLUMNS = ("snr", "snr_db")


@dataclass(frozen=True)
class Pair:
    id: str  # path relative to the noisy folder
    noisy: str
    clean: str
    snr: int | None = None


def snr_of(name: str, pattern: str = SNR_PATTERN) -> int | None:
    """The SNR bucket (dB) that `pattern`'s first group finds in a file name, else None."""
    m = re.search(pattern, Path(name).name, flags=re.IGNORECASE)
    if not m:
        return None
    try:
        return int(round(float(m.group(1))))
    except (IndexError, ValueError):
        raise DataError(f"SNR pattern {pattern!r} must capture a number in its first group") from None


def read_snr_manifest(path) -> dict[str, int]:
    """Base name -> SNR bucket (dB) from a CSV/TSV/JSONL manifest."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"manifest not found: {p}")
    text = p.read_text()
    if p.suffix.lower() in (".jsonl", ".json"):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        rows = list(csv.DictReader(text.splitlines(), delimiter="\t" if "\t" in text.split("\n", 1)[0] else ","))
    out = {}
    for i, row in enumerate(rows):
        key = next((c for c in FILE_COLUMNS if row.get(c)), None)
        snr = next((row[c] for c in SNR_COLUMNS if row.get(c) not in (None, "")), None)
        if key is None or snr is None:
            raise DataError(f"{p}: row {i + 1} needs an 'snr' (or 'snr_db') and one of {', '.join(FILE_COLUMNS)}")
        try:
            out[Path(str(row[key])).name] = int(round(float(snr)))
        except ValueError:
            raise DataError(f"{p}: row {i + 1}: SNR {snr!r} is not a number") from None
    return out


def find_pairs(noisy_dir, clean_dir, snr_pattern: str = SNR_PATTERN, manifest=None) -> list[Pair]:
    """Every noisy file with its clean reference (paired as `enhancer-train eval` pairs them)."""
    if clean_dir is None:
        raise DataError("--clean is required: every peer is scored against the clean reference")
    snrs = read_snr_manifest(manifest) if manifest else {}
    pairs = []
    for p in paired_folders(noisy_dir, clean_dir):
        name = Path(p.noisy).name
        snr = snrs[name] if name in snrs else snr_of(p.name, snr_pattern)
        pairs.append(Pair(p.name, str(p.noisy), str(p.clean), snr))
    return pairs
