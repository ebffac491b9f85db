"""Augmentations, the held-out sources, the unseen-source dev set, the cosine schedule and dev scoring."""
from __future__ import annotations

import math

import numpy as np
import pytest
import soundfile as sf

from tests.conftest import speechlike
from training.cli import main as train_main
from training.data import augment
from training.data.audio_cache import AudioSet
from training.data.holdout import UNSEEN_SOURCES, split_unseen
from training.data.layouts import corpus_layout
from training.data.manifests import Item
from training.data.mixing import active_rms
from training.data.synthesis import AUGMENT_RECIPE, MixConfig, Synthesizer
from training.evaluation.devscore import DevScore
from training.fit import parse_mix_settings, parse_source_weights
from training.loop import cosine_lr, cosine_lr_by_time

SR = 16000


def band_energy_db(x: np.ndarray, lo: float, hi: float) -> float:
    spec = np.abs(np.fft.rfft(x.astype(np.float64))) ** 2
    f = np.fft.rfftfreq(len(x), 1 / SR)
    return 10 * np.log10(spec[(f >= lo) & (f < hi)].sum() / spec.sum())


def sets():
    r = np.random.default_rng(0)
    speech = AudioSet.from_arrays([Item(f"s{i}", group=f"libri {i}", bandwidth_hz=8000) for i in range(6)],
                                  [speechlike(SR * 3, SR, seed=i) for i in range(6)])
    noise = AudioSet.from_arrays([Item(f"n{i}", group=f"n {i}") for i in range(3)],
                                 [(0.1 * r.standard_normal(SR * 2)).astype(np.float32) for _ in range(3)])
    music = AudioSet.from_arrays([Item("m0", group="m 0")], [(0.1 * np.sin(np.arange(40000) * 0.05)).astype(np.float32)])
    return speech, noise, music


def test_lowpass_removes_the_band_above_the_cut():
    x = np.random.default_rng(1).standard_normal(SR).astype(np.float32)
    y = augment.lowpass(x, 4000.0)
    assert band_energy_db(y, 4000, 8000) < -60  # was -3 dB (white noise: half the energy)
    f = np.fft.rfftfreq(SR, 1 / SR)
    X, Y = np.fft.rfft(x.astype(np.float64)), np.fft.rfft(y.astype(np.float64))
    assert np.abs(Y[f < 3700] / X[f < 3700] - 1).max() < 1e-5  # the pass band is untouched (float32 rounding)


def test_reverb_target_is_the_direct_path_plus_early_reflections():
    x = speechlike(SR * 2, SR, seed=3).astype(np.float64)
    wet, target = augment.reverberate(np.random.default_rng(2), x, (0.6, 0.6), (0.0, 0.0), 50.0)
    rng = np.random.default_rng(2)  # the same draws: rt60, DRR, then the response
    h = augment.room_impulse_response(rng, rng.uniform(0.6, 0.6), rng.uniform(0.0, 0.0))
    ref_wet, ref_target = np.convolve(x, h)[: len(x)], np.convolve(x, h[:800])[: len(x)]
    for got, ref in ((wet, ref_wet), (target, ref_target)):
        assert got.shape == x.shape
        assert np.sqrt(np.mean((got - ref) ** 2)) < 1e-5 * np.sqrt(np.mean(ref ** 2))  # float32 output
    # DRR 0 dB: reverberant energy equals the direct path's; the response decays by 60 dB in RT60
    assert h[0] == 1.0 and np.sum(h[1:] ** 2) == pytest.approx(1.0)
    e = np.cumsum(h[1:][::-1] ** 2)[::-1]  # Schroeder backward integral
    t60 = np.argmax(10 * np.log10(e / e[0]) < -20) / SR * 3  # T20 extrapolated to 60 dB
    assert t60 == pytest.approx(0.6, rel=0.15)


def test_speed_change_scales_length_and_pitch():
    t = np.arange(SR) / SR
    x = np.sin(2 * np.pi * 1000 * t).astype(np.float32)
    y = augment.change_speed(x, 1.1)
    assert len(y) == pytest.approx(SR / 1.1, rel=0.01)
    f = np.fft.rfftfreq(len(y), 1 / SR)[np.argmax(np.abs(np.fft.rfft(y)))]
    assert f == pytest.approx(1100, rel=0.01)


def test_eq_stays_within_its_range():
    g = augment.smooth_eq_gain(np.random.default_rng(4), 257, 8.0)
    db = 20 * np.log10(g)
    assert np.abs(db).max() <= 8.0 + 1e-9 and np.abs(db).max() > 1.0


@pytest.mark.parametrize("kind", augment.PROCEDURAL_KINDS)
def test_procedural_noises_are_finite_unit_rms_and_distinct(kind):
    x, k = augment.procedural_noise(np.random.default_rng(5), SR * 2, kind)
    assert k == kind and np.isfinite(x).all()
    assert np.sqrt(np.mean(x.astype(np.float64) ** 2)) == pytest.approx(1.0, rel=1e-3)
    if kind == "hum":  # energy sits at the mains harmonics, below 1 kHz
        assert band_energy_db(x, 0, 1000) > -1.0


def test_coloured_noise_slope():
    x = augment.coloured_noise(np.random.default_rng(6), SR * 4, 2.0)  # brown: -6 dB per octave
    assert band_energy_db(x, 100, 200) - band_energy_db(x, 1600, 3200) == pytest.approx(10 * np.log10(16), abs=1.0)  # 1/f^2 integrated: (1/100-1/200)/(1/1600-1/3200)


def test_recipe_examples_are_valid_reproducible_and_use_every_augmentation():
    speech, noise, music = sets()
    cfg = MixConfig.from_dict({**MixConfig().to_dict(), **AUGMENT_RECIPE})
    synth = Synthesizer(speech, noise, music, cfg, seed=7)
    seen = set()
    for i in range(300):
        e = synth.example(i)
        assert e.noisy.shape == e.clean.shape == (cfg.segment_samples,)
        assert np.isfinite(e.noisy).all() and max(np.abs(e.noisy).max(), np.abs(e.clean).max()) <= 0.99 + 1e-6
        assert 0 < e.bandwidth_hz <= SR / 2
        seen |= {a.split()[0] for a in e.info["augment"]} | {e.info["noise"].split()[0].split("+")[0]}
        if any(a.startswith("lowpass") for a in e.info["augment"]):
            assert e.bandwidth_hz <= 7000
    assert {"reverb", "eq", "speed", "lowpass", "clip", "procedural", "music", "babble", "noise"} <= seen
    again = Synthesizer(speech, noise, music, cfg, seed=7).example(123)
    assert np.array_equal(again.noisy, synth.example(123).noisy)


def test_default_config_draws_the_same_examples_as_before_augmentations():
    """All augmentations off (the default) consumes no random draws: old runs resume unchanged."""
    speech, noise, music = sets()
    base = Synthesizer(speech, noise, music, MixConfig(), seed=3).example(11)
    off = MixConfig.from_dict({**MixConfig().to_dict(), "p_reverb": 0.0, "p_speed": 0.0})
    assert np.array_equal(Synthesizer(speech, noise, music, off, seed=3).example(11).noisy, base.noisy)
    assert base.info["augment"] == []


def tone_sets(freq: float):
    """Speech far below a noise that is one pure tone at `freq` Hz (no music, no babble, no clean draws)."""
    speech, _, _ = sets()
    t = np.arange(SR * 3) / SR
    noise = AudioSet.from_arrays([Item("tone", group="t 0")], [(0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)])
    cfg = {**MixConfig().to_dict(), "p_music": 0.0, "p_babble": 0.0, "p_clean": 0.0, "snr_db": (-40.0, -40.0)}
    return speech, noise, cfg


def peak_hz(x: np.ndarray) -> float:
    spec = np.abs(np.fft.rfft(x.astype(np.float64) * np.hanning(len(x))))
    return float(np.fft.rfftfreq(len(x), 1 / SR)[int(np.argmax(spec))])


@pytest.mark.parametrize("speed", [0.7, 1.4])
def test_noise_speed_moves_the_pitch_of_recorded_noise(speed):
    speech, noise, cfg = tone_sets(500.0)
    synth = Synthesizer(speech, noise, None, MixConfig.from_dict({**cfg, "p_speed_noise": 1.0,
                                                                  "speed_noise": (speed, speed)}), seed=5)
    for i in range(4):
        e = synth.example(i)
        assert e.info["noise"] == f"noise speed {speed:.2f}"
        assert e.noisy.shape == (synth.cfg.segment_samples,)
        assert abs(peak_hz(e.noisy) - 500.0 * speed) <= 2.0  # the FFT's bin is 0.5 Hz at 2 s
    plain = Synthesizer(speech, noise, None, MixConfig.from_dict(cfg), seed=5).example(0)
    assert plain.info["noise"] == "noise" and abs(peak_hz(plain.noisy) - 500.0) <= 2.0


def test_noise_speed_off_draws_the_same_examples():
    """p_speed_noise 0 consumes no random draws, whatever its range: runs resume unchanged."""
    speech, noise, music = sets()
    cfg = {**MixConfig().to_dict(), **AUGMENT_RECIPE}
    base = Synthesizer(speech, noise, music, MixConfig.from_dict(cfg), seed=4)
    other = Synthesizer(speech, noise, music, MixConfig.from_dict({**cfg, "speed_noise": (0.5, 2.0)}), seed=4)
    on = Synthesizer(speech, noise, music, MixConfig.from_dict({**cfg, "p_speed_noise": 1.0}), seed=4)
    differ = 0
    for i in range(40):
        a, b, c = base.example(i), other.example(i), on.example(i)
        assert np.array_equal(a.noisy, b.noisy) and np.array_equal(a.clean, b.clean)
        differ += not np.array_equal(a.noisy, c.noisy)
    assert differ > 0


def test_mix_settings_parse_and_refuse():
    assert parse_mix_settings(["p_reverb=0.3", "rt60_s=0.3,0.8", "babble_talkers=2,9"]) == {
        "p_reverb": 0.3, "rt60_s": (0.3, 0.8), "babble_talkers": (2, 9)}
    for bad in (["p_reverb"], ["nope=1"], ["p_reverb=x"], ["rt60_s=0.3"], ["p_reverb=1.5"]):
        with pytest.raises(ValueError):
            parse_mix_settings(bad)
    with pytest.raises(ValueError, match="unknown mixing setting"):
        MixConfig.from_dict({"bogus": 1})
    assert parse_source_weights(["ambient=3", " 0ad = 0.5"], "--noise-weight") == {"ambient": 3.0, "0ad": 0.5}
    for bad in ("ambient", "=2", "ambient=x", "ambient=-1", "ambient=inf"):
        with pytest.raises(ValueError, match="--noise-weight"):
            parse_source_weights([bad], "--noise-weight")


def test_cosine_schedule():
    assert cosine_lr(0, 1e-3, 10, 110, 0.0) == pytest.approx(1e-4)
    assert cosine_lr(9, 1e-3, 10, 110, 0.0) == pytest.approx(1e-3)
    assert cosine_lr(60, 1e-3, 10, 110, 1e-5) == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5))
    assert cosine_lr(110, 1e-3, 10, 110, 1e-5) == pytest.approx(1e-5)
    assert cosine_lr(500, 1e-3, 10, 110, 1e-5) == pytest.approx(1e-5)


def test_cosine_schedule_over_the_minutes_trained():
    assert cosine_lr_by_time(0, 0.0, 1e-3, 10, 8.0, 0.0) == pytest.approx(1e-4)  # warm-up counts steps
    assert cosine_lr_by_time(9, 0.5, 1e-3, 10, 8.0, 0.0) == pytest.approx(1e-3)
    assert cosine_lr_by_time(10, 0.0, 1e-3, 10, 8.0, 1e-5) == pytest.approx(1e-3)
    assert cosine_lr_by_time(10_000, 4.0, 1e-3, 10, 8.0, 1e-5) == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5))
    assert cosine_lr_by_time(20, 6.0, 1e-3, 10, 8.0, 1e-5) == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5) * (1 - 0.5**0.5))
    assert cosine_lr_by_time(20, 8.0, 1e-3, 10, 8.0, 1e-5) == pytest.approx(1e-5)
    assert cosine_lr_by_time(20, 30.0, 1e-3, 10, 8.0, 1e-5) == pytest.approx(1e-5)


def test_fit_decays_the_lr_over_the_minutes_it_trains_and_resumes_on_that_clock(corpus, tiny_config, cache_dir,
                                                                                 tmp_path, capsys):
    import csv

    import torch

    out = tmp_path / "run"
    args = ["fit", "--config", str(tiny_config), "--data", str(corpus), "--out", str(out), "--max-steps", "4",
            "--batch-size", "2", "--segment-seconds", "0.5", "--valid-every", "0", "--log-every", "1",
            "--norm-examples", "8", "--valid-examples", "4", "--valid-seconds", "1", "--cache-dir", str(cache_dir),
            "--threads", "1", "--precision", "fp32", "--lr", "1e-3", "--jobs", "1", "--quiet",
            "--schedule", "cosine", "--warmup-steps", "1", "--total-minutes", "0.01", "--final-lr", "1e-5"]
    threads = torch.get_num_threads()
    try:
        assert train_main(args) == 0
        assert train_main([*args[:args.index("--max-steps") + 1], "7", *args[args.index("--max-steps") + 2:],
                           "--resume"]) == 0
        assert train_main([*args, "--total-steps", "9"]) == 2
    finally:
        torch.set_num_threads(threads)
    assert "--total-minutes 0.01: needs the cosine schedule, without --total-steps" in capsys.readouterr().err
    with open(out / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["split"] == "train"]
    assert [int(r["step"]) for r in rows] == list(range(1, 8))
    minutes = [0.0] + [60.0 * float(r["hours"]) for r in rows]  # trained before each step
    assert np.all(np.diff(minutes) > 0)
    for r, before in zip(rows, minutes):  # the row of step s: the update that used the lr of step s - 1
        want = cosine_lr_by_time(int(r["step"]) - 1, before, 1e-3, 1, 0.01, 1e-5)
        assert float(r["lr"]) == pytest.approx(want, abs=1e-3 * 1e-3)  # the csv's rounding of hours and lr


def test_dev_score_counts_residual_noise_and_speech_and_trades_neither():
    a = DevScore(2.0, 3.0, 10)
    assert DevScore(2.01, 3.0, 10).better_than(a) and DevScore(2.0, 3.01, 10).better_than(a)
    assert not DevScore(2.01, 1.0, 10).better_than(a)  # more PESQ-WB bought with residual noise
    assert not DevScore(1.9, 3.2, 10).better_than(a)  # less noise bought with speech
    assert DevScore(2.003, 3.004, 10).better_than(a)  # both up a little: the sum clears the tie
    assert not DevScore(2.002, 3.002, 10).better_than(a)  # a tie
    assert not a.better_than(a)
    # without the DNSMOS models, PESQ-WB alone
    b = DevScore(2.0, math.nan, 10)
    assert DevScore(2.01, math.nan, 10).better_than(b) and not DevScore(2.004, math.nan, 10).better_than(b)
    assert a.better_than(None) and not DevScore(math.nan, 3.0, 0).better_than(None)
    assert DevScore.from_dict(a.to_dict()) == a


def test_unseen_sources_leave_training_whole(tmp_path):
    root = tmp_path
    items = [Item(str(root / "noise" / "lugaru" / "wind.ogg")), Item(str(root / "noise" / "0ad" / "rain.ogg")),
             Item(str(root / "music" / "lincity-ng" / "a.ogg")), Item("/elsewhere/noise/lugaru/x.wav")]
    kept, held = split_unseen(items[:2] + items[3:], "noise", root)
    assert held == items[:1] and kept == items[1:2] + items[3:]  # a file outside the corpus is kept
    kept, held = split_unseen(items[2:3], "music", root)
    assert held == items[2:3] and "lincity-ng" in UNSEEN_SOURCES["music"]


def add_unseen_sources(corpus, tmp_path):
    """A copy of the test corpus's manifests plus held-out noise and music sources."""
    import shutil

    root = tmp_path / "corpus"
    shutil.copytree(corpus, root)
    r = np.random.default_rng(9)
    for cat, src in (("noise", "lugaru"), ("music", "unknown-horizons")):
        for split in ("train", "valid"):
            rel = f"{cat}/{src}/{split}.wav"
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            x = (0.1 * r.standard_normal(SR * 2)).astype(np.float32)
            sf.write(root / rel, x, SR)
            with open(root / "manifests" / f"{cat}_{split}.tsv", "a") as f:
                f.write(f"{rel}\t2.000\t{SR}\t{src}\t8000\n")
    return root


def test_corpus_layout_holds_out_unseen_sources_from_both_splits(corpus, tmp_path):
    root = add_unseen_sources(corpus, tmp_path)
    data = corpus_layout(root)
    for lists in (data.train, data.valid):
        for cat in ("noise", "music"):
            assert not any("/lugaru/" in it.path or "/unknown-horizons/" in it.path for it in lists[cat])
    assert len(data.unseen["noise"]) == 2 and len(data.unseen["music"]) == 2
    everything = corpus_layout(root, hold_out=False)
    assert len(everything.train["noise"]) == len(data.train["noise"]) + 1


def test_unseen_devset_uses_only_held_out_noises_and_every_kind(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = add_unseen_sources(corpus, tmp_path)
    out = tmp_path / "dev"
    code = train_main(["devset", "--unseen", "--data", str(root), "--out", str(out), "-n", "18", "--real-pairs", ""])
    assert code == 0
    rows = [line.split("\t") for line in (out / "manifest.tsv").read_text().splitlines()[1:]]
    assert len(rows) == 18
    assert {r[1] for r in rows} == {"-5", "0", "5", "10", "15", "20"}
    assert {r[3] for r in rows} == {"noise", "music", "babble"}
    for r in rows:
        assert r[0].startswith(f"snr{int(r[1]):03d}_{r[3]}_")
        noisy, _ = sf.read(out / "noisy" / r[0])
        clean, _ = sf.read(out / "clean" / r[0])
        snr = 20 * np.log10(active_rms(clean) / active_rms(noisy - clean))
        assert snr == pytest.approx(float(r[1]), abs=0.5)  # 16-bit files: within half a dB
    # without held-out sources in the corpus the command says so
    assert train_main(["devset", "--unseen", "--data", str(corpus), "--out", str(tmp_path / "x")]) == 2


def test_fit_with_augmentation_cosine_schedule_and_dev_selection(corpus, tiny_config, cache_dir, tmp_path):
    import csv

    import torch

    from enhancer import load_checkpoint
    from training.evaluation.devset import build_devset

    threads = torch.get_num_threads()
    dev = build_devset(corpus, tmp_path / "dev", n=4, seconds=(1.5, 1.5), real_pairs=None, cache_root=cache_dir,
                       log=lambda m: None)
    out = tmp_path / "run"
    args = ["fit", "--config", str(tiny_config), "--data", str(corpus), "--out", str(out), "--max-steps", "6",
            "--batch-size", "2", "--segment-seconds", "0.5", "--valid-every", "0", "--log-every", "1",
            "--norm-examples", "8", "--valid-examples", "4", "--valid-seconds", "1", "--cache-dir", str(cache_dir),
            "--threads", "1", "--precision", "fp32", "--lr", "1e-3", "--jobs", "1", "--quiet",
            "--augment", "--mix", "p_reverb=1", "--schedule", "cosine", "--warmup-steps", "2", "--total-steps", "6",
            "--final-lr", "1e-5", "--dev", str(dev), "--dev-every", "3", "--dev-files", "3"]
    try:
        assert train_main(args) == 0
    finally:
        torch.set_num_threads(threads)
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    lrs = {int(r["step"]): float(r["lr"]) for r in rows if r["split"] == "train"}
    assert sorted(lrs) == list(range(1, 7))  # --log-every 1, --max-steps 6
    for step, lr in lrs.items():  # the row of step s is written after the update that used cosine_lr(s - 1)
        assert lr == pytest.approx(cosine_lr(step - 1, 1e-3, 2, 6, 1e-5), rel=1e-3)
    dev_rows = [r for r in rows if r["split"] == "dev_pesq_wb"]
    assert [int(r["step"]) for r in dev_rows] == [3, 6]
    assert all(1.0 <= float(r["loss"]) <= 4.7 for r in dev_rows)  # PESQ-WB's range
    best = load_checkpoint(out / "checkpoints" / "best.pt").checkpoint["extra"]["train"]
    scores = [float(r["loss"]) for r in dev_rows]
    assert any(best["best_dev"]["pesq_wb"] == pytest.approx(s, abs=1e-6) for s in scores)
    assert best["best_dev"]["pesq_wb"] >= max(scores) - 0.005  # the best, or a tie decided by DNSMOS
    assert best["best_dev"]["files"] == 3
    assert best["mix"]["p_reverb"] == 1.0 and best["mix"]["p_speed"] == AUGMENT_RECIPE["p_speed"]
