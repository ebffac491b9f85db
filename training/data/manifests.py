"""Manifests: lists of audio files with duration, sample rate, group (speaker/source) and bandwidth.

Two formats, one row per file:

* TSV with a header row; columns `path`, and optionally `seconds`, `sample_rate`, `group`,
  `bandwidth_hz` (the corpus format: `OUT/manifests/{speech,noise,music}_{train,valid}.tsv`).
* JSONL, one object per line with the same keys.

Relative paths are resolved against `root`: by default the manifest's folder, or its parent when
the folder is called `manifests` (the corpus layout keeps paths relative to the corpus root), or
else the nearest folder above the manifest under which the listed files exist (e.g.
`../shared/data/speech/files.tsv` lists `speech/librispeech/...`, relative to `../shared/data`).

An optional `split` column (`train` / `valid`, as in `files.tsv`) is kept in `Item`-less form by
`read_manifest(path, split=...)`, which returns the rows of that split only.
"""
from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass
from pathlib import Path

COLUMNS = ("path", "seconds", "sample_rate", "group", "bandwidth_hz")


class DataError(ValueError):
    """Training or evaluation data is missing, empty or malformed."""


@dataclass(frozen=True)
class Item:
    path: str  # absolute path
    seconds: float = 0.0  # 0 = unknown
    sample_rate: int = 0  # 0 = unknown
    group: str = ""  # speaker / voice / noise source
    bandwidth_hz: float = 0.0  # 0 = unknown: the Nyquist frequency of the file

    @property
    def source(self) -> str:
        """Corpus-level source of a group ("asterisk en_US_f_Allison" -> "asterisk")."""
        return self.group.split()[0] if self.group.strip() else ""


def default_root(manifest: Path, rel_paths=()) -> Path:
    """The folder the manifest's relative paths start from: `manifests/`'s parent; else the
    manifest's folder or the nearest folder above it (up to 3 levels) in which the first few listed
    files exist; else the manifest's folder (missing files are then reported one by one)."""
    folder = manifest.resolve().parent
    if folder.name == "manifests":
        return folder.parent
    sample = [p for p in rel_paths if p and not Path(p).is_absolute()][:5]
    if sample:
        for candidate in [folder, *list(folder.parents)[:3]]:
            if all((candidate / p).is_file() for p in sample):
                return candidate
    return folder


def manifest_splits(path) -> set[str]:
    """The values of the manifest's `split` column (empty when it has none)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"manifest not found: {path}")
    rows = _read_jsonl(path) if path.suffix in (".jsonl", ".json") else _read_tsv(path)
    return {str(r["split"]).strip() for _, r in rows if r.get("split")}


def read_manifest(path, root=None, split: str | None = None) -> list[Item]:
    """Read a TSV or JSONL manifest (with `split`: only the rows whose `split` column is that).
    Raises `DataError` if it is missing, malformed or empty."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"manifest not found: {path}")
    rows = _read_jsonl(path) if path.suffix in (".jsonl", ".json") else _read_tsv(path)
    if split is not None:
        rows = [(n, r) for n, r in rows if str(r.get("split") or "").strip() == split]
    root = Path(root) if root is not None else default_root(path, [str(r.get("path") or "") for _, r in rows])
    if not root.is_dir():
        raise DataError(f"manifest {path}: root folder {root} does not exist")
    items = []
    for lineno, row in rows:
        if not row.get("path"):
            raise DataError(f"{path}:{lineno}: row without a path")
        try:
            items.append(Item(
                path=str(root / row["path"]),
                seconds=float(row.get("seconds") or 0.0),
                sample_rate=int(float(row.get("sample_rate") or 0)),
                group=str(row.get("group") or ""),
                bandwidth_hz=float(row.get("bandwidth_hz") or 0.0),
            ))
        except (TypeError, ValueError) as e:
            raise DataError(f"{path}:{lineno}: bad value ({e})") from None
    if not items:
        raise DataError(f"manifest {path} lists no files" + (f" of split {split!r}" if split else ""))
    return items


def _read_tsv(path: Path):
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter="\t")
        if reader.fieldnames is None or "path" not in reader.fieldnames:
            raise DataError(f"{path}: a TSV manifest needs a header row with a 'path' column "
                            f"(columns: {', '.join(COLUMNS)})")
        return [(i + 2, row) for i, row in enumerate(reader)]


def _read_jsonl(path: Path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i}: not JSON ({e})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{i}: expected an object per line")
            rows.append((i, row))
    return rows


def write_manifest(items: list[Item], path, root=None) -> Path:
    """Write a TSV manifest; paths are written relative to `root` when they lie under it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    root = Path(root).resolve() if root is not None else None
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter="\t", lineterminator="\n")
        w.writerow(COLUMNS)
        for it in items:
            d = asdict(it)
            p = Path(it.path)
            if root is not None and p.resolve().is_relative_to(root):
                d["path"] = str(p.resolve().relative_to(root))
            w.writerow([d[c] for c in COLUMNS])
    return path


def describe(items: list[Item]) -> str:
    minutes = sum(it.seconds for it in items) / 60.0
    groups = len({it.group for it in items})
    return f"{len(items)} files, {minutes:.1f} min, {groups} groups"
