"""The extra-corpus recipe (training/corpus/extra.tsv.gz): well formed, reproducible (pinned versions and
sha256), and free of evaluation material and of the sources held out for the unseen dev set."""
from __future__ import annotations

import csv
import hashlib
import re
from collections import defaultdict
from pathlib import Path

from training.data.corpus import open_recipe
from training.data.holdout import UNSEEN_SOURCES

RECIPE = Path(__file__).resolve().parents[2] / "training" / "corpus" / "extra.tsv.gz"
COLUMNS = ["split", "category", "package", "version", "deb_member", "zip_member", "sha256", "seconds", "sample_rate",
           "group", "out_path", "bandwidth_hz", "decoded_sha256"]
FORBIDDEN_PACKAGES = ("freedroidrpg", "lugaru", "unknown-horizons", "lincity")
# evaluation material and held-out sources, as they would show in a package name or an out_path
FORBIDDEN_NAMES = FORBIDDEN_PACKAGES + ("freedroid", "noisex", "asterisk-core-sounds-it", "testset", "test_set",
                                        "test-set", "/test/")
# what libsndfile reads as shipped (no MIDI or tracker modules: .mod/.xm/.it/.s3m); MP3 (libsndfile >= 1.1)
# only for the real ambient recordings, which one repository publishes as MP3 alone
LIBSNDFILE_EXTENSIONS = (".ogg", ".opus", ".wav", ".flac")
AMBIENT_EXTENSIONS = LIBSNDFILE_EXTENSIONS + (".mp3",)
VOCAL_WORDS = re.compile(r"vocal|voice|song|sing|lyric|choir|(^|[^a-z])rap([^a-z]|$)", re.IGNORECASE)
MAX_TRAIN_MINUTES_PER_PACKAGE = 90


def rows():
    with open_recipe(RECIPE) as f:
        reader = csv.reader(f, delimiter="\t")
        assert next(reader) == COLUMNS
        return [dict(zip(COLUMNS, r)) for r in reader]


def test_rows_are_pinned_and_complete():
    rs = rows()
    assert len(rs) > 10
    for r in rs:
        assert r["split"] in ("train", "valid") and r["category"] in ("music", "noise", "speech")
        assert r["version"] and len(r["sha256"]) == 64 and int(r["sha256"], 16) >= 0
        assert float(r["seconds"]) > 0 and int(r["sample_rate"]) >= 8000
        assert 0 < float(r["bandwidth_hz"]) <= int(r["sample_rate"]) / 2
        assert r["out_path"].startswith(r["category"] + "/")


def test_no_file_twice_and_no_file_in_both_splits():
    rs = rows()
    assert len({r["out_path"] for r in rs}) == len(rs)
    assert len({r["sha256"] for r in rs}) == len(rs)


def test_no_evaluation_or_held_out_material():
    for r in rows():
        assert not any(p in r["package"] for p in FORBIDDEN_PACKAGES), r["package"]
        for text in (r["package"], r["deb_member"], r["out_path"]):
            assert not any(name in text.lower() for name in FORBIDDEN_NAMES), text
        source = r["out_path"].split("/")[1]
        assert source not in UNSEEN_SOURCES.get(r["category"], ()), r["out_path"]
        if r["package"].startswith("github:") and r["category"] == "speech":  # "<repository name> <speaker>"
            assert r["package"].rsplit("/", 1)[1] == r["group"].split()[0] and len(r["group"].split()) == 2, r["group"]
        elif r["package"].startswith("github:"):  # real ambient noise: "ambient <source>", one corpus-level source
            assert r["group"].split()[0] == "ambient" and len(r["group"].split()) == 2, r["group"]
            assert r["out_path"].startswith(f"noise/ambient/{r['package'].rsplit('/', 1)[1]}/"), r["out_path"]
        else:
            assert r["group"] == r["package"] or r["package"] == "pypi:" + r["group"], r["group"]


def test_music_is_instrumental_long_and_read_by_libsndfile():
    music = [r for r in rows() if r["category"] == "music"]
    assert len(music) > 200
    for r in music:
        name = r["out_path"].rsplit("/", 1)[1]
        assert name.lower().endswith(LIBSNDFILE_EXTENSIONS), r["out_path"]
        assert Path(r["deb_member"]).suffix == Path(r["out_path"]).suffix, r["out_path"]
        assert float(r["seconds"]) >= 20, r["out_path"]
        assert not VOCAL_WORDS.search(name), r["out_path"]
        assert float(r["bandwidth_hz"]) == int(r["sample_rate"]) / 2, r["out_path"]


def test_no_package_dominates_the_music():
    minutes = defaultdict(float)
    for r in rows():
        if r["category"] == "music" and r["split"] == "train":
            minutes[r["package"]] += float(r["seconds"]) / 60
    assert len(minutes) >= 20
    assert max(minutes.values()) <= MAX_TRAIN_MINUTES_PER_PACKAGE, max(minutes.items(), key=lambda kv: kv[1])


def test_speech_is_whole_speakers_for_training_pinned_to_a_commit():
    """New voices go to training whole: the dev sets draw their voices from the corpus's validation
    speakers, so adding validation speakers would change them."""
    speech = [r for r in rows() if r["category"] == "speech"]
    assert len(speech) > 1000
    files = defaultdict(int)
    for r in speech:
        assert r["split"] == "train", r["out_path"]
        assert re.fullmatch(r"github:[\w.-]+/[\w.-]+", r["package"]) and re.fullmatch(r"[0-9a-f]{40}", r["version"]), r["package"]
        assert int(r["sample_rate"]) >= 16000 and r["out_path"].lower().endswith(LIBSNDFILE_EXTENSIONS), r["out_path"]
        assert r["out_path"].split("/")[1] == r["group"].split()[0], r["out_path"]
        files[r["group"]] += 1
    assert len(files) >= 200  # speakers


SYNTHETIC_OR_VOICE = re.compile(r"white|pink|brown|miaow", re.IGNORECASE)


def test_ambient_noise_is_real_training_material_pinned_to_a_commit():
    """The real ambient recordings of public repositories (noise/ambient/): training only (the dev sets
    come from other sources), pinned to a commit, read by libsndfile, no synthetic noise or voice."""
    ambient = [r for r in rows() if r["category"] == "noise" and r["package"].startswith("github:")]
    assert len(ambient) >= 10
    for r in ambient:
        assert r["split"] == "train" and r["out_path"].startswith("noise/ambient/"), r["out_path"]
        assert re.fullmatch(r"github:[\w.-]+/[\w.-]+", r["package"]) and re.fullmatch(r"[0-9a-f]{40}", r["version"]), r["package"]
        assert r["out_path"].lower().endswith(AMBIENT_EXTENSIONS) and not SYNTHETIC_OR_VOICE.search(r["out_path"]), r["out_path"]
        assert Path(r["deb_member"]).suffix == Path(r["out_path"]).suffix, r["out_path"]
        assert float(r["bandwidth_hz"]) == int(r["sample_rate"]) / 2, r["out_path"]
    assert all(r["group"].startswith("ambient ") for r in rows() if r["out_path"].startswith("noise/ambient/"))


# Packages whose music and noise rows were split together, counting both categories (the rule before the
# third round of noise); they keep that split. Every other package is split per package and category.
SPLIT_ACROSS_CATEGORIES = ("extremetuxracer-data", "flare-game", "tuxfootball")


def test_valid_split_is_the_smallest_md5_tenth_of_each_package_and_category():
    by_package = defaultdict(list)
    for r in rows():
        if r["category"] == "speech" or r["package"].startswith("github:"):
            continue  # whole speakers and the ambient recordings: training only (above, below)
        key = r["package"] if r["package"] in SPLIT_ACROSS_CATEGORIES else (r["package"], r["category"])
        by_package[key].append(r)
    for package, rs in by_package.items():
        n = len(rs)
        n_valid = 0 if n < 5 else int(n / 10 + 0.5)  # round half up: 5 files -> 1
        ranked = sorted(rs, key=lambda r: hashlib.md5(r["out_path"].encode()).hexdigest())
        assert {r["out_path"] for r in rs if r["split"] == "valid"} == {r["out_path"] for r in ranked[:n_valid]}, package
