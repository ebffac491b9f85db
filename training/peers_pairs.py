"""Noisy/clean file pairs of the peer benchmark, with the SNR of each when known.

Files pair up by their path relative to the two folders (or, failing that, by file stem). The
SNR comes from a manifest when one is given (CSV, TSV or JSONL with an `snr` column and a file
column: `file`, `name`, `noisy` or `path`, matched by base name), else from the file name
(`snr05_xxx.wav` -> 5 dB with the default pattern `snr(-?\\d+)`).
"""
from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path

from .manifests import DataError

AUDIO_SUFFIXES = {".wav", ".flac", ".ogg", ".opus", ".mp3", ".aiff", ".aif"}
SNR_PATTERN = r"snr(-?\d+)"
FILE_COLUMNS = ("file", "name", "noisy", "path")


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
        if key is None or row.get("snr") in (None, ""):
            raise DataError(f"{p}: row {i + 1} needs an 'snr' and one of {', '.join(FILE_COLUMNS)}")
        out[Path(str(row[key])).name] = int(round(float(row["snr"])))
    return out


def audio_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.rglob("*") if f.is_file() and f.suffix.lower() in AUDIO_SUFFIXES)


def find_pairs(noisy_dir, clean_dir, snr_pattern: str = SNR_PATTERN, manifest=None) -> list[Pair]:
    """Every noisy file with its clean reference. Raises DataError when none pair up or any is unmatched."""
    nd, cd = Path(noisy_dir), Path(clean_dir)
    for d, what in ((nd, "--noisy"), (cd, "--clean")):
        if not d.is_dir():
            raise DataError(f"{what}: not a folder: {d}")
    snrs = read_snr_manifest(manifest) if manifest else {}
    clean = audio_files(cd)
    by_rel = {f.relative_to(cd).as_posix(): f for f in clean}
    by_stem = {}
    for f in clean:
        by_stem.setdefault(f.stem, []).append(f)
    pairs, unmatched = [], []
    for f in audio_files(nd):
        rel = f.relative_to(nd).as_posix()
        c = by_rel.get(rel) or (by_stem[f.stem][0] if len(by_stem.get(f.stem, [])) == 1 else None)
        if c is None:
            unmatched.append(rel)
            continue
        snr = snrs[f.name] if f.name in snrs else snr_of(rel, snr_pattern)
        pairs.append(Pair(rel, str(f), str(c), snr))
    if unmatched:
        shown = ", ".join(unmatched[:5]) + (" ..." if len(unmatched) > 5 else "")
        raise DataError(f"{len(unmatched)} noisy file(s) have no clean reference in {cd}: {shown}")
    if not pairs:
        raise DataError(f"no audio files in {nd}")
    return pairs
