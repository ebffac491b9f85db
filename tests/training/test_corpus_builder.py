"""`enhancer-train corpus` on a tiny fake recipe: a Debian package served by a stand-in `apt-get`
(with a zip inside and a G.722 file), and a `github:` row from a local repository. Files land at
their out_path with their sha256, manifests are written, a re-run downloads nothing, a deleted file
is fetched again (resume), a wrong checksum stops with the member named. Also checks the project's
real recipes (metadata only: nothing is downloaded)."""
from __future__ import annotations

import csv
import gzip
import hashlib
import os
import re
import shutil
import subprocess
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from training.cli import main
from training.data import corpus

HEADER = "\t".join(corpus.COLUMNS) + "\n"
needs_tools = pytest.mark.skipif(any(shutil.which(t) is None for t in ("git", "dpkg-deb", "tar", "ffmpeg")),
                                 reason="the corpus builder test needs git, dpkg-deb, tar and ffmpeg")


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def git(*args, cwd):
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.org"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


def tone(n=8000, f=5.0):
    return (0.1 * np.sin(np.arange(n) / f)).astype(np.float32)


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """A .deb `fake-sounds` 1.0-1 behind a stand-in apt-get, a git mirror, and the recipe rows."""
    pkg = tmp_path / "pkg"
    share = pkg / "usr" / "share" / "fake"
    share.mkdir(parents=True)
    (pkg / "DEBIAN").mkdir()
    (pkg / "DEBIAN" / "control").write_text("Package: fake-sounds\nVersion: 1.0-1\nArchitecture: all\n"
                                            "Maintainer: t <t@example.org>\nDescription: test\n")
    sf.write(str(share / "rain.wav"), tone(), 16000, subtype="PCM_16")
    sf.write(str(tmp_path / "theme.wav"), tone(f=9.0), 16000, subtype="PCM_16")
    with zipfile.ZipFile(share / "assets.zip", "w") as z:
        z.write(tmp_path / "theme.wav", "audio/theme.wav")
    subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-f", "lavfi", "-i", "sine=frequency=300:duration=1",
                    "-ar", "16000", "-ac", "1", "-c:a", "g722", "-f", "g722", str(share / "hello.g722")], check=True)
    debs = tmp_path / "debs"
    debs.mkdir()
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(pkg), str(debs / "fake-sounds_1.0-1_all.deb")],
                   check=True, capture_output=True)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    calls = tmp_path / "apt-calls.txt"
    (bin_ / "apt-get").write_text(f"""#!/bin/sh
echo "$@" >> {calls}
[ "$1" = download ] || exit 0
for a; do spec="$a"; done
name="${{spec%%=*}}"; ver="${{spec#*=}}"
f="{debs}/${{name}}_${{ver}}_all.deb"
[ -f "$f" ] || {{ echo "E: Version '$ver' for '$name' was not found" >&2; exit 100; }}
cp "$f" .
""")
    (bin_ / "apt-get").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")

    repo = tmp_path / "mirrors" / "someone+voices"
    (repo / "WAVE").mkdir(parents=True)
    sf.write(str(repo / "WAVE" / "A.WAV"), tone(f=3.0), 16000, subtype="PCM_16")
    git("init", "-q", cwd=repo)
    git("add", ".", cwd=repo)
    git("commit", "-qm", "audio", cwd=repo)
    commit = git("rev-parse", "HEAD", cwd=repo)
    (repo / "WAVE" / "A.WAV").write_bytes(b"changed after the pinned commit")
    git("commit", "-qam", "later", cwd=repo)
    voice = subprocess.run(["git", "show", f"{commit}:WAVE/A.WAV"], cwd=repo, check=True, capture_output=True).stdout

    wav_ref = tmp_path / "ref.wav"
    subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-f", "g722", "-i", str(share / "hello.g722"), "-c:a", "pcm_s16le",
                    "-ar", "16000", "-ac", "1", "-bitexact", "-f", "wav", str(wav_ref)], check=True)
    rows = [
        ["train", "noise", "fake-sounds", "1.0-1", "usr/share/fake/rain.wav", "", sha(share / "rain.wav"), "0.500", "16000",
         "fake-sounds", "noise/fake/rain.wav", "8000", ""],
        ["valid", "music", "fake-sounds", "1.0-1", "usr/share/fake/assets.zip", "audio/theme.wav", sha(tmp_path / "theme.wav"),
         "0.500", "16000", "fake-sounds", "music/fake/theme.wav", "8000", ""],
        ["train", "speech", "fake-sounds", "1.0-1", "usr/share/fake/hello.g722", "", sha(share / "hello.g722"), "1.000",
         "16000", "fake en", "speech/fake/hello.wav", "7000", sha(wav_ref)],
        ["train", "speech", "github:someone/voices", commit, "WAVE/A.WAV", "", hashlib.sha256(voice).hexdigest(), "0.500",
         "16000", "voices A", "speech/voices/A/a.wav", "8000", ""],
    ]
    recipe = tmp_path / "recipe.tsv"
    recipe.write_text(HEADER + "".join("\t".join(r) + "\n" for r in rows))
    return {"recipe": recipe, "rows": rows, "calls": calls, "mirrors": tmp_path / "mirrors", "share": share}


def build(s, out, *extra):
    return main(["corpus", "--out", str(out), "--recipe", str(s["recipe"]), "--github-mirrors", str(s["mirrors"]),
                 "--no-apt-update", "--jobs", "2", *extra])


@needs_tools
def test_builds_verifies_resumes_and_refuses_a_wrong_checksum(sources, tmp_path, capsys):
    out = tmp_path / "corpus"
    assert build(sources, out) == 0, capsys.readouterr().err
    for r in sources["rows"]:
        if r[12]:  # G.722: the original is kept and decoded to 16 kHz PCM WAV at out_path
            assert sha(out / "g722_originals" / "speech/fake/hello.g722") == r[6]
            x, sr = sf.read(str(out / r[10]))
            assert sr == 16000 and len(x) == 16000
        else:
            assert sha(out / r[10]) == r[6], r[10]
    m = out / "manifests"
    assert (m / "speech_train.tsv").read_text().splitlines() == [
        "path\tseconds\tsample_rate\tgroup\tbandwidth_hz", "speech/fake/hello.wav\t1.000\t16000\tfake en\t7000",
        "speech/voices/A/a.wav\t0.500\t16000\tvoices A\t8000"]
    assert (m / "music_valid.tsv").read_text().splitlines()[1:] == ["music/fake/theme.wav\t0.500\t16000\tfake-sounds\t8000"]
    assert (m / "noise_train.tsv").read_text().splitlines()[1:] == ["noise/fake/rain.wav\t0.500\t16000\tfake-sounds\t8000"]
    assert not (out / ".work" / "downloads").exists()  # downloads are deleted once used
    err = capsys.readouterr().err
    assert "(1/2)" in err and "verified 3 of 3" in err and "summary" in err

    ncalls = len(sources["calls"].read_text().splitlines())
    before = {p: p.read_text() for p in m.iterdir()}
    assert build(sources, out) == 0  # again: everything verified in place, nothing downloaded
    assert len(sources["calls"].read_text().splitlines()) == ncalls
    assert {p: p.read_text() for p in m.iterdir()} == before
    assert capsys.readouterr().err.count("already verified") == 2

    (out / "noise" / "fake" / "rain.wav").unlink()  # an interrupted build: the missing file is fetched again
    assert build(sources, out) == 0
    assert sha(out / "noise" / "fake" / "rain.wav") == sources["rows"][0][6]
    assert "fetching 1 of 3 files" in capsys.readouterr().err

    rows = [list(r) for r in sources["rows"]]
    rows[0][6] = "0" * 64
    rows[0][10] = "noise/fake/rain2.wav"
    sources["recipe"].write_text(HEADER + "".join("\t".join(r) + "\n" for r in rows))
    assert build(sources, out) == 2
    err = capsys.readouterr().err
    assert "sha256 mismatch: usr/share/fake/rain.wav" in err and "run the same command again" in err
    assert not (out / "noise" / "fake" / "rain2.wav").exists()
    assert {p: p.read_text() for p in m.iterdir()} == before  # manifests untouched by a failed build


@needs_tools
def test_only_builds_the_categories_asked_for(sources, tmp_path, capsys):
    out = tmp_path / "corpus"
    assert build(sources, out, "--only", "speech") == 0, capsys.readouterr().err
    assert sorted(p.name for p in (out / "manifests").iterdir()) == ["speech_train.tsv", "speech_valid.tsv"]
    assert not (out / "noise").exists() and not (out / "music").exists()


def test_dry_run_and_errors(tmp_path, capsys):
    assert main(["corpus", "--out", str(tmp_path / "c"), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "debian.tsv.gz" in text and "speech.tsv.gz" in text and "extra.tsv.gz" in text
    assert main(["corpus", "--out", str(tmp_path / "c"), "--only", "speech,babble"]) == 2
    assert "--only takes speech, noise and/or music" in capsys.readouterr().err
    bad = tmp_path / "bad.tsv"
    bad.write_text("path\tsha256\n")
    assert main(["corpus", "--out", str(tmp_path / "c"), "--recipe", str(bad)]) == 2
    assert "header must be the 13 columns" in capsys.readouterr().err
    good = tmp_path / "good.tsv"
    good.write_text(HEADER + "\t".join(["train", "noise", "fake-sounds", "1.0-1", "usr/share/fake/rain.wav", "", "0" * 64,
                                        "0.5", "16000", "fake-sounds", "noise/fake/rain.wav", "8000", ""]) + "\n")
    packed = tmp_path / "good.tsv.gz"  # the project's recipes are gzipped: the same rows either way
    packed.write_bytes(gzip.compress(good.read_bytes()))
    rows = corpus.read_recipe(packed)
    assert len(rows) == 1 and rows == [replace(r, recipe="good.tsv.gz") for r in corpus.read_recipe(good)]
    broken = tmp_path / "broken.tsv.gz"
    broken.write_bytes(gzip.compress(good.read_bytes())[:-12])
    assert main(["corpus", "--out", str(tmp_path / "c"), "--recipe", str(broken), "--dry-run"]) == 2
    assert "broken.tsv.gz: not a readable gzip file" in capsys.readouterr().err
    damaged = bytearray(gzip.compress(good.read_bytes()))
    damaged[12:-8] = bytes(b ^ 0x55 for b in damaged[12:-8])  # the deflate body, header and trailer kept
    broken.write_bytes(bytes(damaged))
    assert main(["corpus", "--out", str(tmp_path / "c"), "--recipe", str(broken), "--dry-run"]) == 2
    assert "broken.tsv.gz: not a readable gzip file" in capsys.readouterr().err
    inside = Path(corpus.__file__).resolve().parents[2] / "training" / "corpus-out-test"
    assert main(["corpus", "--out", str(inside), "--recipe", str(good)]) == 2
    assert "inside the checkout and not git-ignored" in capsys.readouterr().err
    shutil.rmtree(inside, ignore_errors=True)
    assert not inside.exists()


# --------------------------------------------------------------------------- the real recipes
def recipe_rows(name):
    with corpus.open_recipe(corpus.RECIPE_DIR / name) as f:
        return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


def test_the_project_recipes_are_complete_pinned_and_free_of_evaluation_material():
    rows = corpus.load_recipes([corpus.RECIPE_DIR / n for n in corpus.RECIPES])  # no out_path twice, all well formed
    assert len(rows) > 30000 and {r.recipe for r in rows} == set(corpus.RECIPES)
    for r in rows:
        if r.source_kind == "github":
            assert re.fullmatch(r"[0-9a-f]{40}", r.version), r.package
        text = f"{r.package} {r.deb_member} {r.out_path}".lower()
        assert not any(w in text for w in ("test-clean", "test-other", "dev-clean", "dev-other", "test_set", "testset",
                                           "freedroid", "noisex", "asterisk-core-sounds-it")), text
        assert not re.search(r"(^|[/_ ])p(228|232|257)([/_ ]|$)", f"{r.group} {r.out_path} {r.deb_member}"), r.out_path
    speech = recipe_rows("speech.tsv.gz")
    assert len(speech) == 281 and {r["package"] for r in speech} == {"github:resemble-ai/Resemblyzer",
                                                                      "github:auspicious3000/autovc"}
    assert all("train-clean-100" in r["deb_member"] for r in speech if "librispeech" in r["out_path"])
    assert {r["group"] for r in speech if "vctk" in r["out_path"]} == {"vctk p225", "vctk p226", "vctk p227"}
