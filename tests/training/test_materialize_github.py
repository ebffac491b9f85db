"""materialize_extra.sh on `github:<owner>/<repo>` rows, against a local repository in
$GITHUB_MIRRORS: the pinned commit's bytes land at their out_path with a manifest row, a re-run
changes nothing, and a wrong sha256 stops the script with the member named."""
from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

SCRIPT = Path(__file__).resolve().parents[2] / "training" / "corpus" / "materialize_extra.sh"
HEADER = ("split\tcategory\tpackage\tversion\tdeb_member\tzip_member\tsha256\tseconds\tsample_rate\tgroup\t"
          "out_path\tbandwidth_hz\tdecoded_sha256\n")
needs_tools = pytest.mark.skipif(any(shutil.which(t) is None for t in ("git", "apt-get", "dpkg-deb", "unzip", "sha256sum")),
                                 reason="materialize_extra.sh needs git, apt-get, dpkg-deb, unzip and sha256sum")


def git(*args, cwd):
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.org"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


def run(tsv, out, mirrors):
    env = {**os.environ, "EXTRA_TSV": str(tsv), "GITHUB_MIRRORS": str(mirrors)}
    return subprocess.run(["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True)


@needs_tools
def test_github_rows_from_a_mirror(tmp_path):
    repo = tmp_path / "mirrors" / "someone+voices"
    (repo / "WAVE" / "S1").mkdir(parents=True)
    x = (0.1 * np.sin(np.arange(8000) / 5.0)).astype(np.float32)
    sf.write(str(repo / "WAVE" / "S1" / "A.WAV"), x, 16000, subtype="PCM_16")
    git("init", "-q", cwd=repo)
    git("add", ".", cwd=repo)
    git("commit", "-qm", "audio", cwd=repo)
    commit = git("rev-parse", "HEAD", cwd=repo)
    (repo / "WAVE" / "S1" / "A.WAV").write_bytes(b"changed after the pinned commit")
    git("commit", "-qam", "later", cwd=repo)
    sha = hashlib.sha256(subprocess.run(["git", "show", f"{commit}:WAVE/S1/A.WAV"], cwd=repo, check=True,
                                        capture_output=True).stdout).hexdigest()
    tsv = tmp_path / "extra.tsv"
    row = ["train", "speech", "github:someone/voices", commit, "WAVE/S1/A.WAV", "", sha, "0.500", "16000",
           "voices S1", "speech/voices/S1/a.wav", "8000", ""]
    tsv.write_text(HEADER + "\t".join(row) + "\n")
    out = tmp_path / "corpus"

    r = run(tsv, out, tmp_path / "mirrors")
    assert r.returncode == 0, r.stderr
    got = out / "speech" / "voices" / "S1" / "a.wav"
    assert hashlib.sha256(got.read_bytes()).hexdigest() == sha  # the pinned commit's bytes, not the later ones
    manifest = (out / "manifests" / "speech_train.tsv").read_text().splitlines()
    assert manifest == ["path\tseconds\tsample_rate\tgroup\tbandwidth_hz",
                        "speech/voices/S1/a.wav\t0.500\t16000\tvoices S1\t8000"]
    r = run(tsv, out, tmp_path / "mirrors")  # again: verified in place, nothing appended
    assert r.returncode == 0 and "already verified" in r.stdout, r.stdout + r.stderr
    assert (out / "manifests" / "speech_train.tsv").read_text().splitlines() == manifest

    packed = tmp_path / "extra.tsv.gz"  # the project's recipe is gzipped: the same corpus from it
    packed.write_bytes(gzip.compress(tsv.read_bytes()))
    r = run(packed, tmp_path / "corpus-gz", tmp_path / "mirrors")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "corpus-gz" / "manifests" / "speech_train.tsv").read_text().splitlines() == manifest
    assert hashlib.sha256((tmp_path / "corpus-gz" / "speech" / "voices" / "S1" / "a.wav").read_bytes()).hexdigest() == sha
    packed.write_bytes(b"not gzip")
    r = run(packed, tmp_path / "corpus-gz", tmp_path / "mirrors")
    assert r.returncode != 0 and "extra.tsv.gz: not a readable gzip file" in r.stderr, r.stderr

    row[6] = "0" * 64  # a recipe whose checksum the repository does not match
    row[10] = "speech/voices/S1/b.wav"
    tsv.write_text(HEADER + "\t".join(row) + "\n")
    r = run(tsv, out, tmp_path / "mirrors")
    assert r.returncode != 0 and "sha256 mismatch: WAVE/S1/A.WAV" in r.stderr, r.stderr
    assert not (out / "speech" / "voices" / "S1" / "b.wav").exists()
