"""The extra-corpus recipe (training/corpus/extra.tsv): well formed, reproducible (pinned versions and
sha256), and free of evaluation material and of the sources held out for the unseen dev set."""
from __future__ import annotations

import csv
from pathlib import Path

from training.holdout import UNSEEN_SOURCES

RECIPE = Path(__file__).resolve().parents[2] / "training" / "corpus" / "extra.tsv"
COLUMNS = ["split", "category", "package", "version", "deb_member", "zip_member", "sha256", "seconds", "sample_rate",
           "group", "out_path", "bandwidth_hz", "decoded_sha256"]
FORBIDDEN_PACKAGES = ("freedroidrpg", "lugaru", "unknown-horizons", "lincity")


def rows():
    with open(RECIPE, newline="", encoding="utf-8") as f:
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
        source = r["out_path"].split("/")[1]
        assert source not in UNSEEN_SOURCES.get(r["category"], ()), r["out_path"]
