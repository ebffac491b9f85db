"""`enhancer-train pack` / `fit --shards`: the packed corpus round-trips (FLAC exactly, Opus within a
waveform SNR), spreads over folders, refuses a damaged shard; the batch feeder's workers give the
batches the trainer would make itself; and a run on a packed corpus equals one on the corpus."""
from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest

from tests.tolerance import snr_db
from tests.training.test_fit import fit_args, losses
from training.cli import main
from training.data.audio_cache import AudioSet
from training.data.feeder import BatchFeeder
from training.data.manifests import DataError, Item
from training.data.shards import load, pack
from training.data.synthesis import MixConfig, Synthesizer


def speech_set(n: int = 5, seed: int = 0) -> AudioSet:
    from tests.conftest import speechlike

    clips = [speechlike(int(16000 * (0.5 + 0.3 * i)), 16000, seed=seed + i) for i in range(n)]
    items = [Item(path=f"/x/{i}.wav", seconds=len(c) / 16000, sample_rate=16000, group=f"src g{i % 2}",
                  bandwidth_hz=8000.0 - 1000 * (i % 2)) for i, c in enumerate(clips)]
    return AudioSet.from_arrays(items, clips)


def noise_set(n: int = 3) -> AudioSet:
    r = np.random.default_rng(3)
    clips = [(0.1 * r.standard_normal(8000 + 4000 * i)).astype(np.float32) for i in range(n)]
    return AudioSet.from_arrays([Item(path=f"/n/{i}.wav", group="noise") for i in range(n)], clips)


def sets():
    return {("speech", "train"): speech_set(), ("speech", "valid"): speech_set(3, seed=50),
            ("noise", "train"): noise_set(), ("noise", "valid"): noise_set(2)}


def test_flac_round_trip_is_exact_to_16_bits_and_spreads_over_folders(tmp_path):
    src = sets()
    index = pack(src, tmp_path / "a", codec="flac", shard_mb=0.05, log=lambda *_: None)
    assert len(index["sets"]["speech_train"]["shards"]) > 1  # small shards: clips spread over several
    # move half the shards to a second folder: the loader finds them in either
    (tmp_path / "b").mkdir()
    for p in sorted((tmp_path / "a").glob("*.flac"))[::2]:
        shutil.move(str(p), tmp_path / "b" / p.name)
    got = load([tmp_path / "a", tmp_path / "b"], log=lambda *_: None)
    assert set(got) == set(src)
    for key, s in src.items():
        g = got[key]
        assert list(g.items) == list(s.items)  # group and bandwidth travel with the clips
        assert list(g.lengths) == list(s.lengths)
        for i in range(len(s)):
            q = np.round(np.asarray(s.clip(i)) * 32768.0) / 32768.0  # the 16-bit grid
            np.testing.assert_array_equal(g.clip(i), q.astype(np.float32))


def test_opus_round_trip_keeps_lengths_and_the_waveform(tmp_path):
    src = sets()
    index = pack(src, tmp_path, codec="opus", quality=0.5, log=lambda *_: None)
    assert index["sets"]["speech_train"]["snr_db"] > 15.0
    got = load(tmp_path, log=lambda *_: None)
    s, g = src["speech", "train"], got["speech", "train"]
    assert list(g.lengths) == list(s.lengths)
    for i in range(len(s)):
        assert snr_db(np.asarray(s.clip(i)), g.clip(i)) > 12.0  # aligned (no codec delay) and close


def test_loud_clips_are_scaled_not_clipped(tmp_path):
    loud = AudioSet.from_arrays([Item(path="/l.wav", group="g")], [np.linspace(-1.6, 1.6, 16000, dtype=np.float32)])
    src = {**sets(), ("noise", "train"): loud}
    pack(src, tmp_path, codec="flac", log=lambda *_: None)
    got = load(tmp_path, log=lambda *_: None)["noise", "train"].clip(0)
    assert abs(float(got.max()) - 1.6) < 1e-3 * 1.6


def test_damaged_or_missing_shards_are_named(tmp_path):
    pack(sets(), tmp_path, codec="flac", log=lambda *_: None)
    shard = sorted(tmp_path.glob("noise_train-*.flac"))[0]
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="sha256"):
        load(tmp_path, log=lambda *_: None)
    shard.unlink()
    with pytest.raises(DataError, match=f"shard {shard.name} not found"):
        load(tmp_path, log=lambda *_: None)
    with pytest.raises(DataError, match="no index.json"):
        load(tmp_path / "nowhere", log=lambda *_: None)


def test_max_hours_keeps_a_subset_of_whole_clips(tmp_path):
    s = speech_set(8)
    index = pack({("speech", "train"): s, ("speech", "valid"): speech_set(2), ("noise", "train"): noise_set(),
                  ("noise", "valid"): noise_set(2)}, tmp_path, codec="flac",
                 max_hours={"speech_train": 2.0 / 3600}, log=lambda *_: None)
    clips = index["sets"]["speech_train"]["clips"]
    assert 0 < len(clips) < len(s)
    assert 2.0 <= sum(c["length"] for c in clips) / 16000 < 2.0 + float(s.lengths.max()) / 16000
    assert len(index["sets"]["speech_valid"]["clips"]) == 2  # other sets whole


def test_feeder_gives_the_trainers_own_batches():
    s = sets()
    synth = Synthesizer(s["speech", "train"], s["noise", "train"], None,
                        MixConfig(segment_seconds=0.5, p_reverb=0.5, p_eq_noise=0.5), seed=7)
    feeder = BatchFeeder(synth, batch_size=3, stride=6, first=3, workers=2)  # rank 1 of 2
    try:
        assert feeder.n_slots == 3
        for k in range(7):  # the ring of shared slots goes round twice
            want = synth.batch(range(3 + 6 * k, 6 + 6 * k))
            got = feeder.next(3 + 6 * k)
            for w, g in zip(want, got):
                np.testing.assert_array_equal(g, w)
        got = feeder.next(300)  # off the plan (a resume): re-planned, not a wrong batch
        np.testing.assert_array_equal(got[0], synth.batch(range(300, 303))[0])
        got = feeder.next()
        np.testing.assert_array_equal(got[1], synth.batch(range(306, 309))[1])
    finally:
        feeder.close()


class _FailsOn(Synthesizer):
    def example(self, index):
        if index == 7:
            raise DataError("example 7: could not draw non-silent speech")
        return super().example(index)


def test_a_workers_error_reaches_the_trainer_with_its_message():
    s = sets()
    synth = _FailsOn(s["speech", "train"], s["noise", "train"], None, MixConfig(segment_seconds=0.5), seed=7)
    feeder = BatchFeeder(synth, batch_size=4, stride=4, first=0, workers=2)
    try:
        np.testing.assert_array_equal(feeder.next()[0], synth.batch(range(4))[0])
        with pytest.raises(DataError, match="example 7"):
            feeder.next()
        np.testing.assert_array_equal(feeder.next()[0], synth.batch(range(8, 12))[0])  # the feeder goes on
    finally:
        feeder.close()


def test_fit_on_packed_shards_with_workers_equals_fit_on_the_corpus(corpus, tiny_config, cache_dir, tmp_path):
    packed = tmp_path / "packed"
    assert main(["pack", "--data", str(corpus), "--out", str(packed), "--codec", "flac",
                 "--cache-dir", str(cache_dir), "--jobs", "1"]) == 0
    index = json.loads((packed / "index.json").read_text())
    assert set(index["sets"]) == {"speech_train", "speech_valid", "noise_train", "noise_valid", "music_train",
                                  "music_valid"}
    a, b = tmp_path / "a", tmp_path / "b"
    args = fit_args(corpus, tiny_config, cache_dir, a, 6)
    assert main(args) == 0
    i = args.index("--data")
    shard_args = args[:i] + ["--shards", str(packed), "--data-workers", "2"] + args[i + 2:]
    shard_args[shard_args.index("--out") + 1] = str(b)
    assert main(shard_args) == 0
    la, lb = losses(a), losses(b)
    assert sorted(lb) == list(range(1, 7))
    # the same examples up to the 16-bit rounding of the packed audio (different examples differ by
    # several per cent on this corpus)
    for step in la:
        assert abs(float(lb[step]) - float(la[step])) <= 1e-2 * abs(float(la[step]))
    c = tmp_path / "c"
    args[args.index("--out") + 1] = str(c)
    assert main(args + ["--data-workers", "2"]) == 0
    assert losses(c) == la  # the workers make exactly the trainer's own batches
    with open(b / "metrics.csv", newline="") as f:
        assert all(r["split"] == "train" for r in csv.DictReader(f))


def test_fit_refuses_two_sources(corpus, tiny_config, cache_dir, tmp_path, capsys):
    args = fit_args(corpus, tiny_config, cache_dir, tmp_path / "x", 1) + ["--shards", str(tmp_path)]
    assert main(args) == 2
    assert "exactly one data source" in capsys.readouterr().err


def test_bench_fit_times_the_model_and_the_mixing(corpus, tiny_config, cache_dir, tmp_path, capsys):
    packed = tmp_path / "packed"
    assert main(["pack", "--data", str(corpus), "--out", str(packed), "--codec", "flac",
                 "--cache-dir", str(cache_dir), "--jobs", "1"]) == 0
    out = tmp_path / "bench.json"
    assert main(["bench-fit", "--batch", "1,2", "--steps", "1", "--segment-seconds", "0.5", "--threads", "1",
                 "--precision", "fp32", "--shards", str(packed), "--augment", "--mixing-batches", "1",
                 "--data-workers", "2", "--feeder-batch", "4", "--feeder-batches", "3", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [r["batch"] for r in got["model"]] == [1, 2]
    for r in got["model"]:  # audio-s/s is the batch's audio over the measured step
        assert r["step_ms"] > 0 and abs(r["model_audio_s_per_s"] * r["step_ms"] / 1e3 - r["batch"] * 0.5) < 1e-6 * r["batch"]
    assert got["mixing_audio_s_per_s_per_core"] > 0
    f = got["feeder"]
    assert (f["workers"], f["batch"], f["batches"]) == (2, 4, 3)
    assert f["audio_s_per_s"] > 0 and f["trainer_cpu_ms_per_batch"] >= 0
    printed = capsys.readouterr().out
    assert "mixing (augment)" in printed and "feeder, 2 worker(s), batch 4" in printed


def test_codec_for_packs_the_speech_lossless_beside_opus_noise(tmp_path):
    src = sets()
    index = pack(src, tmp_path, codec="opus", codec_for={"speech": "flac"}, log=lambda *_: None)
    assert index["sets"]["speech_train"]["codec"] == "flac" and index["sets"]["noise_train"]["codec"] == "opus"
    assert sorted(p.suffix for p in tmp_path.glob("speech_*")) == [".flac", ".flac"]
    assert sorted(p.suffix for p in tmp_path.glob("noise_*")) == [".opus", ".opus"]
    got = load(tmp_path, log=lambda *_: None)
    s, g = src["speech", "train"], got["speech", "train"]
    for i in range(len(s)):  # the clean speech exactly, on the 16-bit grid
        q = np.round(np.asarray(s.clip(i)) * 32768.0) / 32768.0
        np.testing.assert_array_equal(g.clip(i), q.astype(np.float32))
    with pytest.raises(ValueError, match="codec must be one of"):
        pack(src, tmp_path / "x", codec_for={"speech": "mp3"}, log=lambda *_: None)
