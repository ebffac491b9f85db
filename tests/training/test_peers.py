"""Peer benchmark: availability, delay alignment, runner, reports, SNR buckets (no peer installed)."""
import argparse
import csv
import json
import os

import numpy as np
import pytest
import soundfile as sf

from tests.conftest import speechlike
from training.data.manifests import DataError
from training.evaluation.metrics import PESQ_WB_FLOOR
from training.peers.adapters import PEERS, Peer, make_peer
from training.peers.align import estimate_delay, fit, measure_delay, resample
from training.peers.cli import add_bench_peers, cmd_bench_peers, peer_names
from training.peers.pairs import find_pairs, read_snr_manifest, snr_of
from training.peers.report import markdown, summarize, write_reports
from training.peers.run import PeerSpec, describe, run_benchmark
from training.peers.score import score


class Delayed(Peer):
    """A fake peer: identity at 48 kHz that delays its output by `delay` samples."""

    name = "delayed"
    rate = 48000
    delay = 123

    def process(self, x):
        return np.concatenate([np.zeros(self.delay, np.float32), x])


class Absent(Peer):
    name = "absent"
    package = "no-such-peer==1.0"
    module = "no_such_peer_module_xyz"


# ---------------------------------------------------------------------- availability
def test_missing_peer_reports_not_installed():
    peer = Absent()
    assert peer.missing() == "not installed (pip install no-such-peer==1.0)"
    with pytest.raises(RuntimeError, match="not installed"):
        peer.enhance(np.zeros(160, np.float32), 16000)


def test_every_peer_answers_available_or_why_not():
    for name in PEERS:
        reason = make_peer(name, model="/nonexistent/tim.onnx").missing()
        assert reason is None or (isinstance(reason, str) and reason)
    assert "no model at" in make_peer("tim-enhancer", model="/nonexistent/tim.onnx").missing()


def test_uninstalled_peer_is_unavailable_not_fatal(tmp_path, monkeypatch):
    monkeypatch.setitem(PEERS, "absent", Absent)
    info = describe(PeerSpec("absent"))
    assert info["status"] == "unavailable" and info["reason"].startswith("not installed")
    pairs = _pairs(tmp_path)
    [res] = run_benchmark(pairs, [PeerSpec("absent")], isolate=False)
    assert res["status"] == "unavailable" and res["rows"] == []


# ---------------------------------------------------------------------- alignment
def test_estimate_delay_recovers_a_known_shift():
    x = speechlike(8000)
    for d in (0, 7, 384):
        y = np.concatenate([np.zeros(d, np.float32), 0.8 * x])[: len(x)]
        assert estimate_delay(x, y, 500) == d
    assert estimate_delay(np.concatenate([np.zeros(5, np.float32), x]), x, 50) == -5


def test_measure_delay_and_enhance_remove_a_peer_delay():
    peer = Delayed()
    x = speechlike(16000)
    assert measure_delay(peer, x, 16000) == 123
    y = peer.enhance(x, 16000)
    assert y.shape == x.shape and y.dtype == np.float32
    assert estimate_delay(x, y, 200) == 0
    # soxr round trip 16 -> 48 -> 16 kHz: close to the input except for the band edge
    assert np.corrcoef(x[100:-100], y[100:-100])[0, 1] > 0.99


def test_fit_and_resample_lengths():
    y = np.arange(10, dtype=np.float32)
    np.testing.assert_array_equal(fit(y, 3, 4), [3, 4, 5, 6])
    np.testing.assert_array_equal(fit(y, 8, 4), [8, 9, 0, 0])
    assert len(resample(np.zeros(16001, np.float32), 16000, 48000)) == 48003
    assert len(resample(np.zeros(100, np.float32), 16000, 48000, length=299)) == 299


# ---------------------------------------------------------------------- SNR buckets
def test_snr_from_names_and_manifest(tmp_path):
    assert snr_of("snr05_xxx.wav") == 5
    assert snr_of("sub/SNR20_a.flac") == 20
    assert snr_of("mix_snr-5_b.wav") == -5
    assert snr_of("p287_001.wav") is None
    assert snr_of("db10_x.wav", r"db(\d+)") == 10
    m = tmp_path / "m.tsv"
    m.write_text("file\tsnr\nsub/a.wav\t7.6\nb.wav\t0\n")
    assert read_snr_manifest(m) == {"a.wav": 8, "b.wav": 0}
    j = tmp_path / "m.jsonl"
    j.write_text('{"noisy": "a.wav", "snr": 15}\n')
    assert read_snr_manifest(j) == {"a.wav": 15}
    bad = tmp_path / "bad.csv"
    bad.write_text("file,level\na.wav,3\n")
    with pytest.raises(DataError, match="snr"):
        read_snr_manifest(bad)


# ---------------------------------------------------------------------- runner and reports
def _pairs(tmp_path, names=("snr05_a.wav", "snr10_b.wav"), seconds=2.0):
    """Noisy == clean pairs of speech-like audio."""
    nd, cd = tmp_path / "noisy", tmp_path / "clean"
    nd.mkdir(exist_ok=True)
    cd.mkdir(exist_ok=True)
    for i, n in enumerate(names):
        x = speechlike(int(seconds * 16000), seed=i)
        sf.write(nd / n, x, 16000, subtype="FLOAT")
        sf.write(cd / n, x, 16000, subtype="FLOAT")
    return find_pairs(nd, cd)


def test_find_pairs_matches_and_complains(tmp_path):
    pairs = _pairs(tmp_path)
    assert [(p.id, p.snr) for p in pairs] == [("snr05_a.wav", 5), ("snr10_b.wav", 10)]
    sf.write(tmp_path / "noisy" / "extra.wav", np.zeros(160, np.float32), 16000)
    with pytest.raises(DataError, match="no clean reference"):
        find_pairs(tmp_path / "noisy", tmp_path / "clean")
    with pytest.raises(DataError, match="not found"):
        find_pairs(tmp_path / "nope", tmp_path / "clean")


def test_noisy_identity_scores_pesq_max_in_a_worker_process(tmp_path):
    pairs = _pairs(tmp_path)
    [res] = run_benchmark(pairs, [PeerSpec("noisy")], isolate=True)
    assert res["status"] == "ok" and len(res["rows"]) == 2
    for row in res["rows"]:
        assert row["error"] == ""
        assert row["pesq_wb"] == pytest.approx(4.64, abs=0.01)
        assert row["stoi"] == pytest.approx(1.0, abs=1e-3) and row["estoi"] == pytest.approx(1.0, abs=1e-3)
        assert row["si_sdr"] > 60


class Halver(Peer):
    """Returns its input at half the level (6 dB quieter)."""

    name = "halver"

    def process(self, x):
        return 0.5 * x


def test_speech_level_reports_how_loud_each_peer_returns_the_speech(tmp_path, monkeypatch):
    monkeypatch.setitem(PEERS, "halver", Halver)
    pairs = _pairs(tmp_path)
    results = run_benchmark(pairs, [PeerSpec("noisy"), PeerSpec("halver")], isolate=False)
    for res, level in zip(results, (0.0, 20 * np.log10(0.5))):
        assert [r["error"] for r in res["rows"]] == ["", ""]
        for row in res["rows"]:
            assert row["speech_level"] == pytest.approx(level, abs=1e-3)
    summary = summarize(results)
    halver = summary["peers"]["halver"]
    assert halver["mean"]["speech_level"] == pytest.approx(-6.02, abs=0.01)
    assert halver["mean"]["pesq_wb"] == pytest.approx(4.64, abs=0.01)  # PESQ-WB does not see the level
    assert halver["by_snr"]["5"]["speech_level_median"] == pytest.approx(-6.02, abs=0.01)
    md = markdown(summary)
    assert "## Speech level per SNR bucket (the median file, dB)" in md
    assert "| halver | -6.02 | -6.02 | -6.02 |" in md and "| noisy | 0.00 | 0.00 | 0.00 |" in md


def test_the_speech_level_median_is_not_pulled_down_by_a_removed_voice(tmp_path, monkeypatch):
    class Muter(Peer):
        """Halves the two short files, returns digital silence for the long one."""

        name = "muter"

        def process(self, x):
            return 0.0 * x if len(x) > 40000 else 0.5 * x

    monkeypatch.setitem(PEERS, "muter", Muter)
    nd, cd = tmp_path / "noisy", tmp_path / "clean"
    _pairs(tmp_path, names=("snr05_a.wav", "snr05_b.wav"), seconds=2.0)
    x = speechlike(48000, seed=7)
    sf.write(nd / "snr05_c.wav", x, 16000, subtype="FLOAT")
    sf.write(cd / "snr05_c.wav", x, 16000, subtype="FLOAT")
    [res] = run_benchmark(find_pairs(nd, cd), [PeerSpec("muter")], isolate=False)
    assert [r["error"] for r in res["rows"]] == ["", "", ""]  # the removed voice is scored, not a failure
    muted = res["rows"][2]
    assert muted["file"] == "snr05_c.wav" and muted["pesq_wb"] == PESQ_WB_FLOOR and muted["si_sdr"] == -200.0
    muter = summarize([res])["peers"]["muter"]
    assert muter["mean"]["speech_level"] == pytest.approx((2 * -6.02 - 100.0) / 3, abs=0.01)
    assert muter["mean"]["speech_level_median"] == pytest.approx(-6.02, abs=0.01)
    assert muter["by_snr"]["5"]["speech_level_median"] == pytest.approx(-6.02, abs=0.01)


class Flaky(Peer):
    """Fails on the second file it sees (by length), passes the first through."""

    name = "flaky"

    def process(self, x):
        if len(x) > 40000:
            raise RuntimeError("boom")
        return x


def test_a_peer_failing_on_a_file_is_reported_and_skipped(tmp_path, monkeypatch):
    monkeypatch.setitem(PEERS, "flaky", Flaky)
    nd, cd = tmp_path / "noisy", tmp_path / "clean"
    pairs = _pairs(tmp_path, names=("snr00_short.wav",), seconds=2.0)
    x = speechlike(48000, seed=5)
    sf.write(nd / "snr20_long.wav", x, 16000, subtype="FLOAT")
    sf.write(cd / "snr20_long.wav", x, 16000, subtype="FLOAT")
    pairs = find_pairs(nd, cd)
    results = run_benchmark(pairs, [PeerSpec("noisy"), PeerSpec("flaky")], isolate=False)
    flaky = results[1]
    assert [bool(r["error"]) for r in flaky["rows"]] == [False, True]
    assert "boom" in flaky["rows"][1]["error"]
    s = summarize(results)
    assert s["peers"]["flaky"]["files_scored"] == 1 and s["peers"]["flaky"]["files_failed"] == 1
    md = markdown(s)
    assert "| flaky |" in md and "1/2" in md and "flaky on snr20_long.wav: RuntimeError: boom" in md


class Crashing(Peer):
    """Kills its own process on long inputs (a native crash, as far as the runner can tell)."""

    name = "crashing"

    def process(self, x):
        if len(x) > 40000:
            os._exit(3)
        return x


def test_a_peer_process_dying_on_a_file_is_reported_and_the_next_file_runs(tmp_path):
    nd, cd = tmp_path / "noisy", tmp_path / "clean"
    _pairs(tmp_path, names=("a_short.wav", "c_short.wav"), seconds=1.5)
    x = speechlike(48000, seed=5)
    sf.write(nd / "b_long.wav", x, 16000, subtype="FLOAT")
    sf.write(cd / "b_long.wav", x, 16000, subtype="FLOAT")
    spec = PeerSpec(f"{Crashing.__module__}:Crashing")
    [res] = run_benchmark(find_pairs(nd, cd), [spec], isolate=True)
    assert res["name"] == "crashing" and res["status"] == "ok"
    assert [r["file"] for r in res["rows"]] == ["a_short.wav", "b_long.wav", "c_short.wav"]
    assert [r["error"] for r in res["rows"]] == ["", "the peer's process died on this file", ""]
    assert res["rows"][2]["pesq_wb"] == pytest.approx(4.64, abs=0.01)


def test_unknown_custom_peer_fails_cleanly(tmp_path):
    [res] = run_benchmark(_pairs(tmp_path), [PeerSpec("no_such_module:Nope")], isolate=False)
    assert res["status"] == "failed" and "no_such_module" in res["reason"] and res["rows"] == []


def test_reports_have_the_right_shape(tmp_path, monkeypatch):
    monkeypatch.setitem(PEERS, "absent", Absent)
    pairs = _pairs(tmp_path)
    results = run_benchmark(pairs, [PeerSpec("noisy"), PeerSpec("absent")], isolate=False)
    paths = write_reports(results, tmp_path / "out", {"noisy": "n", "clean": "c"})
    rows = list(csv.DictReader(paths["csv"].open()))
    assert len(rows) == 2 and {r["snr"] for r in rows} == {"5", "10"}
    assert set(rows[0]) >= {"peer", "file", "snr", "pesq_wb", "stoi", "estoi", "si_sdr", "speech_level", "rtf", "error"}
    summary = json.loads(paths["json"].read_text())
    noisy = summary["peers"]["noisy"]
    assert summary["files"] == 2 and noisy["status"] == "ok"
    assert set(noisy["mean"]) == {"pesq_wb", "stoi", "estoi", "si_sdr", "speech_level", "speech_level_median"}
    assert noisy["mean"]["pesq_wb"] == pytest.approx(4.64, abs=0.01)
    assert noisy["mean"]["speech_level"] == pytest.approx(0.0, abs=1e-4)
    assert set(noisy["by_snr"]) == {"5", "10"} and noisy["by_snr"]["5"]["files"] == 1
    assert noisy["rtf"] >= 0 and noisy["audio_seconds"] == pytest.approx(4.0)
    assert summary["peers"]["absent"]["status"] == "unavailable"
    md = paths["md"].read_text()
    assert "| Peer | PESQ-WB | STOI | ESTOI | SI-SDR (dB) | Speech level (dB) |" in md
    assert "## PESQ-WB per SNR bucket" in md and "| 5 dB | 10 dB | all |" in md
    assert "- absent: unavailable: not installed" in md


def test_score_rejects_unaligned_and_resamples():
    x = speechlike(32000)
    with pytest.raises(ValueError, match="aligned"):
        score(x[:-1], x, 16000)
    s = score(resample(x, 16000, 48000), resample(x, 16000, 48000), 48000)
    assert s["pesq_wb"] == pytest.approx(4.64, abs=0.01)


# ---------------------------------------------------------------------- command line
def _args(argv):
    parser = argparse.ArgumentParser()
    add_bench_peers(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench-peers", *argv])


def test_command_writes_reports_and_lists(tmp_path, capsys):
    _pairs(tmp_path)
    out = tmp_path / "report"
    args = _args(["--noisy", str(tmp_path / "noisy"), "--clean", str(tmp_path / "clean"), "--out", str(out),
                  "--peers", "noisy,tim-enhancer", "--model", str(tmp_path / "missing.onnx")])
    assert cmd_bench_peers(args) == 0
    assert {p.name for p in out.iterdir()} == {"per_file.csv", "summary.json", "summary.md"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["peers"]["tim-enhancer"]["status"] == "unavailable"
    assert "| noisy |" in capsys.readouterr().out
    assert cmd_bench_peers(_args(["--list"])) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in PEERS)
    with pytest.raises(DataError, match="unknown"):
        peer_names("noisy,nope")
    assert peer_names("rnnoise,noisy") == ["noisy", "rnnoise"]
    with pytest.raises(DataError, match="--noisy"):
        cmd_bench_peers(_args([]))


def test_tim_enhancer_row_runs_the_model(tmp_path, model_path):
    pairs = _pairs(tmp_path, names=("snr05_a.wav",), seconds=1.0)
    [res] = run_benchmark(pairs, [PeerSpec("tim-enhancer", str(model_path), "tim-test")], isolate=False)
    assert res["name"] == "tim-test" and res["status"] == "ok"
    [row] = res["rows"]
    assert row["error"] == "" and np.isfinite(row["pesq_wb"]) and row["seconds"] == pytest.approx(1.0)


def test_reports_break_down_by_noise_kind(tmp_path):
    pairs = _pairs(tmp_path, names=("snr-05_music_0001.wav", "snr005_babble_0002.wav", "real_p287_001.wav"), seconds=1.0)
    results = run_benchmark(pairs, [PeerSpec("noisy")], isolate=False)
    paths = write_reports(results, tmp_path / "out")
    noisy = json.loads(paths["json"].read_text())["peers"]["noisy"]
    assert {k: v["files"] for k, v in noisy["by_kind"].items()} == {"music": 1, "babble": 1, "real": 1}
    assert noisy["by_kind"]["music"]["pesq_wb"] == pytest.approx(4.64, abs=0.01)  # noisy == clean here
    md = paths["md"].read_text()
    assert "## PESQ-WB per noise kind (from the file names)\n\n| Peer | music | babble | real | all |" in md
    assert "## STOI per noise kind (from the file names)" in md and "DNSMOS" not in md


class LevelJudge:
    """A stand-in for DNSMOS: BAK falls with the level of the signal (a louder residue rates lower), SIG
    rises with it."""

    def score(self, audio):
        level_db = 10 * np.log10(np.mean(np.square(audio)) + 1e-12)
        return {"sig": 3.0 + (level_db + 60.0) / 40.0, "bak": 4.0 - (level_db + 60.0) / 20.0, "ovrl": 2.5}


def test_dnsmos_is_reported_overall_per_snr_and_per_kind(tmp_path, monkeypatch):
    import training.peers.run as run

    monkeypatch.setitem(run._judges, "judge", LevelJudge())
    pairs = _pairs(tmp_path, names=("snr05_music_0001.wav", "snr010_babble_0002.wav"), seconds=1.0)
    results = run_benchmark(pairs, [PeerSpec("noisy", dnsmos="judge")], isolate=False)
    paths = write_reports(results, tmp_path / "out")
    summary = json.loads(paths["json"].read_text())
    assert summary["metrics"] == ["pesq_wb", "stoi", "estoi", "si_sdr", "speech_level", "dnsmos_sig", "dnsmos_bak", "dnsmos_ovrl"]
    noisy = summary["peers"]["noisy"]
    levels = [10 * np.log10(np.mean(np.square(sf.read(p.noisy, dtype="float32")[0]))) for p in pairs]
    expected = [4.0 - (lv + 60.0) / 20.0 for lv in levels]
    assert noisy["mean"]["dnsmos_bak"] == pytest.approx(np.mean(expected), rel=1e-4)
    assert noisy["by_snr"]["5"]["dnsmos_bak"] == pytest.approx(expected[0], rel=1e-4)
    assert noisy["by_kind"]["babble"]["dnsmos_bak"] == pytest.approx(expected[1], rel=1e-4)
    assert noisy["mean"]["dnsmos_ovrl"] == pytest.approx(2.5)
    rows = list(csv.DictReader(paths["csv"].open()))
    sig = [3.0 + (lv + 60.0) / 40.0 for lv in levels]
    assert float(rows[0]["dnsmos_sig"]) == pytest.approx(sig[0], rel=1e-4)
    md = paths["md"].read_text()
    assert "| Peer | PESQ-WB | STOI | ESTOI | SI-SDR (dB) | Speech level (dB) | DNSMOS SIG | DNSMOS BAK | DNSMOS OVRL |" in md
    for judged in ("SIG", "BAK", "OVRL"):
        assert f"## DNSMOS {judged} per SNR bucket" in md and f"## DNSMOS {judged} per noise kind" in md
    # the tables carry the numbers: SIG per SNR (5, 10 dB, all), BAK per kind (music, babble, all)
    assert f"| noisy | {sig[0]:.3f} | {sig[1]:.3f} | {np.mean(sig):.3f} |" in md.split("## DNSMOS SIG per SNR")[1]
    assert f"| noisy | {expected[0]:.3f} | {expected[1]:.3f} | {np.mean(expected):.3f} |" in \
        md.split("## DNSMOS BAK per noise kind")[1]


def test_dnsmos_folder_from_the_flags(tmp_path):
    from training.peers.cli import dnsmos_for

    assert dnsmos_for(_args(["--no-dnsmos"])) is None
    assert dnsmos_for(_args(["--dnsmos", str(tmp_path)])) == str(tmp_path)
    with pytest.raises(DataError, match="--dnsmos: folder not found"):
        dnsmos_for(_args(["--dnsmos", str(tmp_path / "nope")]))


# ---------------------------------------------------------------------- the full-band evaluation's places
def test_fullband_finds_its_data_beside_the_checkout_or_where_the_flags_say(tmp_path):
    """`training.peers.fullband` names no machine's paths: the corpus and the DNSMOS models default
    to `../enhancer-data` and `../shared/data/dnsmos` beside the repository, and flags move them."""
    from training.defaults import CHECKOUT, Defaults
    from training.peers.fullband import build_parser

    a = build_parser().parse_args([])
    assert a.data == CHECKOUT.parent / "enhancer-data"
    assert a.dnsmos in (None, CHECKOUT.parent / "shared" / "data" / "dnsmos")
    d = Defaults(dnsmos_dir=tmp_path / "dnsmos", real_pairs=tmp_path / "pairs", corpus=tmp_path / "corpus")
    a = build_parser(d).parse_args([])
    assert (a.data, a.dnsmos) == (tmp_path / "corpus", tmp_path / "dnsmos")
    a = build_parser(d).parse_args(["--data", str(tmp_path / "other"), "--no-dnsmos"])
    assert a.data == tmp_path / "other" and a.no_dnsmos


def test_fullband_without_a_corpus_is_a_usage_error(tmp_path, capsys):
    from training.peers.fullband import main

    with pytest.raises(SystemExit) as e:
        main(["--data", str(tmp_path), "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "no manifests/ folder" in capsys.readouterr().err
