"""`python -m tools.gpustage` on the CPU: prepare a tiny corpus in several pieces, move them as the
printed calls say into a stand-in for the device's tree, run two steps there; and the failures: a
damaged or missing piece stops the run at once, with the reason in summary.json and the log."""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from tools import gpustage, gpustage_pack


@pytest.fixture(scope="module")
def carried(corpus, cache_dir, tiny_ckpt, tmp_path_factory) -> Path:
    """gpu-carry/ of the tiny corpus, in pieces of 0.5 MiB, with the tiny model as the init."""
    out = tmp_path_factory.mktemp("here") / "gpu-carry"
    rc = gpustage.main(["prepare", "--data", str(corpus), "--out", str(out), "--cache-dir", str(cache_dir),
                        "--piece-mb", "0.5", "--no-wheels", "--init", str(tiny_ckpt), "--minutes", "1.5", "--",
                        "--batch-size", "2", "--segment-seconds", "1", "--norm-examples", "4", "--valid-every", "0",
                        "--threads", "1", "--log-every", "1", "--checkpoint-minutes", "0"])
    assert rc == 0
    return out


def device_tree(carried: Path, tmp_path: Path, skip: int | None = None) -> Path:
    """Make each call's moves (all but call `skip`) in a fresh folder standing for the device's tree."""
    plan = json.loads((carried / "plan.json").read_text())
    root = tmp_path / "device"
    for k, call in enumerate(plan["calls"]):
        for c in call["carry"]:  # the tool copies the carried paths into the tree
            src, dst = carried.parent / c, root / c
            dst.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
        if k != skip:
            subprocess.run(call["move"], shell=True, cwd=root, check=True, capture_output=True)
    return root


def test_prepare_writes_pieces_plan_and_calls(carried):
    plan = json.loads((carried / "plan.json").read_text())
    pieces = plan["pieces"]
    assert len(pieces) >= 2 and plan["format"] == gpustage_pack.FORMAT
    assert all(p["mib"] <= 0.5 for p in pieces)
    assert "init.pt" in pieces[0]["files"] and plan["init"] == "piece-00/init.pt"
    assert sum((carried / p["name"] / f"part-{k:02d}").stat().st_size for k, p in enumerate(pieces)) == plan["tar"]["bytes"]
    assert set(plan["pack"]) >= {"speech_train", "noise_train", "speech_valid", "noise_valid"}
    calls = plan["calls"]
    assert [c["carry"][0] for c in calls] == [f"gpu-carry/{p['name']}" for p in pieces]
    assert calls[-1]["carry"][1] == "gpu-carry/plan.json" and all(c["run"] is None for c in calls[:-1])
    assert calls[-1]["command"].endswith("python3 -m tools.gpustage run --plan gpu-carry/plan.json --minutes 1.5")
    assert plan["fit"][:2] == ["--batch-size", "2"]
    assert not (carried / "staging").exists() and not (carried / "corpus.tar").exists()


def test_run_trains_averages_and_reports(carried, tmp_path, monkeypatch):
    root = device_tree(carried, tmp_path)
    out = tmp_path / "OUT"
    monkeypatch.chdir(root)
    rc = gpustage.main(["run", "--plan", "gpu-carry/plan.json", "--minutes", "1.5", "--out", str(out), "--",
                        "--max-steps", "2", "--schedule", "cosine", "--warmup-steps", "1"])
    summary = json.loads((out / "summary.json").read_text())
    assert rc == 0, summary
    assert summary["status"] == "ok" and summary["error"] is None
    assert set(gpustage_pack.OUTPUTS) <= set(summary["outputs"]) == {p.name for p in out.iterdir()}
    assert summary["fit"]["result"]["step"] == 2 and summary["fit"]["returncode"] == 0
    assert 0 < summary["fit"]["result"]["data_wait_share"] < 1  # on the CPU the trainer mixes its own batches
    assert summary["checkpoints_averaged"] == ["step-00000001.pt", "step-00000002.pt"]
    assert summary["throughput"]["rows"] == 2 and summary["throughput"]["median"] > 0
    assert summary["device"]["cuda"] is False and summary["below_expected"] is False
    assert summary["wall_s"] < 90 + 5
    cmd = summary["fit"]["command"]
    assert cmd[cmd.index("--init") + 1].endswith("piece-00/init.pt") and cmd[cmd.index("--precision") + 1] == "bf16"
    assert (root / ".gpu/shards/index.json").is_file()
    minutes = float(cmd[cmd.index("--max-minutes") + 1])  # the cosine decays over the fit's share of its budget
    assert float(cmd[cmd.index("--total-minutes") + 1]) == pytest.approx(gpustage.SCHEDULE_SHARE * minutes, abs=1e-3)
    from enhancer import load_checkpoint

    assert load_checkpoint(out / "gpustage.pt").checkpoint["extra"]["averaged"]
    trained = 60.0 * float((out / "metrics.csv").read_text().splitlines()[-1].split(",")[2])
    again = tmp_path / "OUT2"  # a second run resumes the run and its schedule: the minutes trained count
    assert gpustage.main(["run", "--plan", "gpu-carry/plan.json", "--minutes", "1.5", "--out", str(again), "--",
                          "--max-steps", "3", "--schedule", "cosine", "--warmup-steps", "1"]) == 0
    cmd = json.loads((again / "summary.json").read_text())["fit"]["command"]
    assert "--init" not in cmd and trained > 0
    total, minutes = (float(cmd[cmd.index(f) + 1]) for f in ("--total-minutes", "--max-minutes"))
    assert total == pytest.approx(trained + gpustage.SCHEDULE_SHARE * minutes, abs=1e-3)


def test_a_damaged_piece_stops_the_run_at_once(carried, tmp_path, monkeypatch):
    root = device_tree(carried, tmp_path)
    part = root / ".gpu" / "piece-01" / "part-01"
    part.write_bytes(part.read_bytes()[:-10])  # a partial copy
    out = tmp_path / "OUT"
    monkeypatch.chdir(root)
    assert gpustage.main(["run", "--plan", "gpu-carry/plan.json", "--out", str(out)]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["stage"] == "pieces" and "fit" not in summary
    assert "piece-01/part-01: sha256 differs" in summary["error"] and "repeat call 2" in summary["error"]
    assert "FAILED at pieces" in (out / "gpustage.log").read_text()
    assert not (root / ".gpu" / "shards").exists()


@pytest.mark.parametrize("member", ["../outside.flac", "/abs.flac", "shards/link.flac"])
def test_the_pack_unpacks_only_plain_files_inside_its_folder(tmp_path, member):
    """On every Python the stage may meet (Debian 12's 3.11.2 has no tarfile filters; the device's 3.12
    has them): a member that would land outside, or a link, stops the unpack before anything is written."""
    body = b"fLaC" + bytes(60)
    good, bad = tarfile.TarInfo("shards/a.flac"), tarfile.TarInfo(member)
    good.size = bad.size = len(body)
    if member.endswith("link.flac"):
        bad.type, bad.linkname, bad.size = tarfile.SYMTYPE, "/etc/passwd", 0
    with tarfile.open(tmp_path / "ok.tar", "w") as t:
        t.addfile(good, io.BytesIO(body))
    with tarfile.open(tmp_path / "ok.tar") as t:
        gpustage.extract_pack(t, tmp_path / "ok")
    assert (tmp_path / "ok" / "shards" / "a.flac").read_bytes() == body
    with tarfile.open(tmp_path / "bad.tar", "w") as t:
        t.addfile(good, io.BytesIO(body))
        t.addfile(bad, io.BytesIO(body))
    with tarfile.open(tmp_path / "bad.tar") as t, pytest.raises(gpustage.Failure, match="not a plain file or folder"):
        gpustage.extract_pack(t, tmp_path / "bad" / "in")
    assert not (tmp_path / "bad").exists() and not (tmp_path / "outside.flac").exists()


def test_a_missing_piece_names_the_call_to_repeat(carried, tmp_path, monkeypatch):
    root = device_tree(carried, tmp_path, skip=0)
    out = tmp_path / "OUT"
    monkeypatch.chdir(root)
    assert gpustage.main(["run", "--plan", "gpu-carry/plan.json", "--out", str(out)]) == 1
    error = json.loads((out / "summary.json").read_text())["error"]
    assert "piece-00/" in error and "is missing: repeat call 1: carry gpu-carry/piece-00" in error


def test_the_run_shrinks_to_fit_the_device_budget(tmp_path, capsys):
    staging = tmp_path / "pack"
    staging.mkdir()
    (staging / "index.json").write_text(json.dumps({"sets": {"speech_train": {"seconds": 3600.0}}}))
    (staging / "speech_train-000.flac").write_bytes(bytes(1 << 20))
    args = ["prepare", "--staging", str(staging), "--piece-mb", "0.1", "--no-wheels", "--init", ""]
    assert gpustage.main([*args, "--out", str(tmp_path / "a" / "gpu-carry")]) == 0  # 11 pieces: 7 minutes left
    plan = json.loads((tmp_path / "a" / "gpu-carry" / "plan.json").read_text())
    assert len(plan["pieces"]) == 11 and plan["minutes"] == 7 and plan["init"] is None
    printed = capsys.readouterr().out
    assert plan["calls"][-1]["command"].endswith("--minutes 7") and "11. carry" in printed
    assert "the 8 minutes beside the run are estimates" in printed and "the minutes left less 1" in printed
    assert gpustage.main([*args, "--out", str(tmp_path / "b" / "gpu-carry"), "--budget", "10"]) == 2
    assert "pack less" in capsys.readouterr().err


@pytest.mark.skipif(not (gpustage_pack.ROOT / ".git").exists(), reason="the tree that travels is what git lists")
def test_every_device_call_has_room_for_a_quarter_of_the_pack():
    """Each device call carries the whole checkout, so what the checkout weighs comes off every piece:
    today's 251 MiB pack goes in 11 pieces (7 of 15 device minutes left to train) while a call keeps
    24 MiB for its piece. Fails when the checkout grows (e.g. the corpus recipes committed unzipped:
    8.1 MB instead of 1.7)."""
    tree = gpustage_pack.tree_mib()
    assert tree > 30  # the models are tracked: the measure sees them
    room = gpustage_pack.CALL_MIB - gpustage_pack.MARGIN_MIB - tree
    assert room >= 24, f"the checkout is {tree:.1f} MiB: a device call keeps only {room:.1f} MiB for a piece"


def test_the_default_recipe_trains_the_shipped_model_on_its_whole_attention_window(tmp_path, capsys):
    from enhancer import load_checkpoint
    from training.loop import context_note

    staging = tmp_path / "pack"
    staging.mkdir()
    (staging / "index.json").write_text(json.dumps({"sets": {"speech_train": {"seconds": 3600.0}}}))
    (staging / "speech_train-000.flac").write_bytes(bytes(1 << 16))
    init = str(gpustage_pack.ROOT / "models" / "tim.pt")
    args = ["prepare", "--staging", str(staging), "--no-wheels", "--init", init]

    assert gpustage.main([*args, "--out", str(tmp_path / "a" / "gpu-carry")]) == 0
    fit = json.loads((tmp_path / "a" / "gpu-carry" / "plan.json").read_text())["fit"]
    seconds, batch = float(fit[fit.index("--segment-seconds") + 1]), int(fit[fit.index("--batch-size") + 1])
    cfg = load_checkpoint(init).config
    assert cfg.attention_window == 256 and seconds == 6.1 and batch == 84  # 512 s of audio per step
    assert context_note(cfg, round(seconds * 16000)) is None  # a third of the frames see all 256
    assert context_note(cfg, round((seconds - 0.1) * 16000)) is not None  # the shortest such segment
    assert "warning" not in capsys.readouterr().err

    # the recipe's 4 s segments: none of 249 trained frames sees the window; said before any device time
    assert gpustage.main([*args, "--out", str(tmp_path / "b" / "gpu-carry"), "--",
                          "--batch-size", "128", "--segment-seconds", "4"]) == 0
    assert "0 of the 249 frames of a segment see the full 256-frame" in capsys.readouterr().err
    assert json.loads((tmp_path / "b" / "gpu-carry" / "plan.json").read_text())["fit"] == [
        "--batch-size", "128", "--segment-seconds", "4"]

    # flags without --segment-seconds: fit's default 2 s
    assert gpustage.main([*args, "--out", str(tmp_path / "c" / "gpu-carry"), "--", "--batch-size", "256"]) == 0
    assert "0 of the 124 frames of a segment see the full 256-frame" in capsys.readouterr().err

    # fit's other spellings of the flag are read as fit reads them; a flag fit refuses stops here
    assert gpustage.main([*args, "--out", str(tmp_path / "d" / "gpu-carry"), "--", "--segment-seconds=6.4"]) == 0
    assert "warning" not in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        gpustage.main([*args, "--out", str(tmp_path / "e" / "gpu-carry"), "--", "--segment-seconds", "six"])
    assert stop.value.code == 2 and "--segment-seconds: invalid float value: 'six'" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()

    assert gpustage_pack.default_fit(None)[-4:] == ["--batch-size", "128", "--segment-seconds", "4"]  # the preset


@pytest.mark.parametrize("returncode, status", [(-15, "ok"), (-9, "partial")])
def test_a_signal_after_fit_printed_its_result_loses_nothing(carried, tmp_path, monkeypatch, returncode, status):
    """fit stops at --max-minutes, saves and prints its result; the stage's SIGTERM may still reach it
    while its process exits (a 14 GB CPU run took 11 s): that run is whole. A SIGKILL is not."""
    real = gpustage._fit

    def late_signal(*args):
        rc, text = real(*args)
        assert rc == 0
        return returncode, text

    monkeypatch.setattr(gpustage, "_fit", late_signal)
    monkeypatch.chdir(device_tree(carried, tmp_path))
    out = tmp_path / "OUT"
    rc = gpustage.main(["run", "--plan", "gpu-carry/plan.json", "--minutes", "1.5", "--out", str(out), "--",
                        "--max-steps", "1"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == status and rc == (0 if status == "ok" else 1)
    assert summary["fit"]["returncode"] == returncode and summary["fit"]["result"]["step"] == 1
    assert (out / "gpustage.pt").is_file()


def test_hours_replace_only_the_sets_they_name():
    """`prepare --hours speech_train=1` caps the training speech and keeps every other set's default
    (the validation sets' small caps above all), as `pack` reads its --max-hours pairs."""
    from training.data.shards import _assignments

    def caps(pairs):
        return _assignments(pairs, "--max-hours", "SET=HOURS", float)

    default = caps(gpustage_pack.HOURS)
    assert caps(gpustage_pack.pack_hours(None)) == default
    got = caps(gpustage_pack.pack_hours(["speech_train=1", "noise_train=2"]))
    assert got == {**default, "speech_train": 1.0, "noise_train": 2.0}
    assert got["music_valid"] == default["music_valid"] < 1
