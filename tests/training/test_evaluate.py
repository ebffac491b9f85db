"""`enhancer-train eval`: metrics against direct pesq/pystoi calls, layouts, streaming, checkpoints, DNSMOS."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from pesq import pesq
from pystoi import stoi

from tests.conftest import speechlike
from tests.tolerance import assert_close_to_peak, assert_differs
from training.cli import main
from training.defaults import default_dnsmos_dir
from training.evaluation.metrics import PESQ_WB_FLOOR, SPEECH_LEVEL_FLOOR_DB, pesq_wb, si_sdr, speech_level

DNSMOS_DIR = default_dnsmos_dir()
needs_dnsmos = pytest.mark.skipif(DNSMOS_DIR is None, reason="../shared/data/dnsmos not present")


def make_pairs(root: Path, n: int = 2, seconds: float = 2.5, noise: float = 0.0, sr: int = 16000):
    for folder in ("noisy", "clean"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        x = speechlike(int(sr * seconds), sr, seed=i + 1)
        y = x + noise * np.random.default_rng(i).standard_normal(len(x)).astype(np.float32)
        sf.write(str(root / "clean" / f"f{i}.wav"), x, sr)
        sf.write(str(root / "noisy" / f"f{i}.wav"), y, sr)
    return root / "noisy", root / "clean"


def read_rows(out: Path) -> dict[str, dict]:
    with open(out / "per_file.csv", newline="") as f:
        return {r["name"]: r for r in csv.DictReader(f)}


def test_identical_folders_score_perfectly_and_match_direct_calls(tiny_onnx, tmp_path):
    noisy, clean = make_pairs(tmp_path / "same", noise=0.0)
    out = tmp_path / "report"
    assert main(["eval", "--model", str(tiny_onnx), "--noisy", str(noisy), "--clean", str(clean), "--out", str(out),
                 "--no-dnsmos", "--jobs", "2"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["files"] == 2
    assert summary["noisy"]["pesq_wb"] == pytest.approx(4.644, abs=0.01)
    assert summary["noisy"]["si_sdr"] > 100 and summary["noisy"]["stoi"] > 0.999
    assert set(summary["enhanced"]) == {"pesq_wb", "stoi", "estoi", "si_sdr", "speech_level"}
    assert summary["noisy"]["speech_level"] == pytest.approx(0.0, abs=1e-3)
    rows = read_rows(out)
    assert set(rows) == {"f0.wav", "f1.wav"}
    for name, row in rows.items():
        ref, _ = sf.read(str(clean / name), dtype="float32")
        enh, sr = sf.read(str(out / "enhanced" / name), dtype="float32")
        assert sr == 16000 and len(enh) == len(ref)
        assert float(row["enhanced_pesq_wb"]) == pytest.approx(pesq(16000, ref, enh, "wb"), abs=1e-3)
        assert float(row["enhanced_stoi"]) == pytest.approx(stoi(ref, enh, 16000), abs=1e-3)
        assert float(row["enhanced_estoi"]) == pytest.approx(stoi(ref, enh, 16000, extended=True), abs=1e-3)
        assert float(row["enhanced_si_sdr"]) == pytest.approx(si_sdr(ref, enh), abs=1e-3)
        assert float(row["enhanced_speech_level"]) == pytest.approx(speech_level(ref, enh), abs=1e-3)
    md = (out / "summary.md").read_text()
    assert "| PESQ-WB | 4.64" in md and "| metric | noisy | enhanced | change |" in md


def test_noisy_metrics_match_direct_calls(tiny_onnx, tmp_path):
    noisy, clean = make_pairs(tmp_path / "n", n=1, noise=0.02)
    out = tmp_path / "report"
    assert main(["eval", "--model", str(tiny_onnx), "--noisy", str(noisy), "--clean", str(clean), "--out", str(out),
                 "--no-dnsmos"]) == 0
    row = read_rows(out)["f0.wav"]
    ref, _ = sf.read(str(clean / "f0.wav"), dtype="float32")
    deg, _ = sf.read(str(noisy / "f0.wav"), dtype="float32")
    assert float(row["noisy_pesq_wb"]) == pytest.approx(pesq(16000, ref, deg, "wb"), abs=1e-3)
    assert float(row["noisy_stoi"]) == pytest.approx(stoi(ref, deg, 16000), abs=1e-3)
    # SI-SDR of white noise at a known level: 10 log10(P_ref / P_noise)
    expected = 10 * np.log10(np.var(ref) / np.var(deg - ref))
    assert float(row["noisy_si_sdr"]) == pytest.approx(expected, abs=0.1)
    assert float(row["noisy_pesq_wb"]) < 4.0


def test_si_sdr_properties():
    x = speechlike(16000, seed=1)
    assert si_sdr(x, 0.5 * x) == pytest.approx(200.0)  # scale-invariant, identical -> ceiling
    n = np.random.default_rng(0).standard_normal(len(x)).astype(np.float32)
    n *= np.sqrt(np.var(x) / np.var(n)) / 10 ** (10 / 20)
    assert si_sdr(x, x + n) == pytest.approx(10.0, abs=0.2)


def test_a_silent_output_scores_the_floor_not_the_ceiling_or_an_error():
    x = speechlike(32000, seed=4)
    silent = np.zeros_like(x)
    assert pesq_wb(x, silent) == PESQ_WB_FLOOR  # the PESQ code itself fails on digital silence
    assert pesq_wb(x, 1e-30 * x) == PESQ_WB_FLOOR
    assert si_sdr(x, silent) == -200.0
    assert speech_level(x, silent) == SPEECH_LEVEL_FLOOR_DB
    # the floor is the scale's bottom: pure noise scores just above it, the reference itself at the top
    noise = np.random.default_rng(0).standard_normal(len(x)).astype(np.float32)
    assert PESQ_WB_FLOOR < pesq_wb(x, noise) < 1.2 and pesq_wb(x, x) == pytest.approx(4.644, abs=0.001)
    assert np.isnan(pesq_wb(silent, x))  # no speech in the reference: nothing to score against


def test_speech_level_properties():
    x = speechlike(32000, seed=2)
    assert speech_level(x, x) == pytest.approx(0.0, abs=1e-9)
    assert speech_level(x, 0.5 * x) == pytest.approx(20 * np.log10(0.5), abs=1e-6)  # -6.02 dB
    # noise uncorrelated with the speech does not count: 0.5 x plus noise as loud as the speech
    n = np.random.default_rng(3).standard_normal(len(x)) * np.std(x)
    n -= (n @ x) / (x @ x) * x  # exactly orthogonal to x
    assert speech_level(x, 0.5 * x + n) == pytest.approx(20 * np.log10(0.5), abs=1e-6)
    # a longer output is cropped to the reference (as every metric here); none of it, or its inverse, hits the floor
    assert speech_level(x, np.concatenate([0.25 * x, n])) == pytest.approx(20 * np.log10(0.25), abs=1e-6)
    assert speech_level(x, np.zeros_like(x)) == SPEECH_LEVEL_FLOOR_DB
    assert speech_level(x, -x) == SPEECH_LEVEL_FLOOR_DB
    assert np.isnan(speech_level(np.zeros_like(x), x))


def test_streaming_and_checkpoint_agree_with_offline_onnx(tiny_ckpt, tiny_onnx, tmp_path):
    noisy, clean = make_pairs(tmp_path / "d", n=1, seconds=1.5, noise=0.05)
    ckpt = tiny_ckpt
    outs = {}
    for tag, model, extra in (("onnx", tiny_onnx, []), ("stream", tiny_onnx, ["--streaming"]),
                              ("ckpt", ckpt, []), ("ckpt-stream", ckpt, ["--streaming"])):
        outs[tag] = tmp_path / tag
        assert main(["eval", "--model", str(model), "--noisy", str(noisy), "--clean", str(clean), "--out", str(outs[tag]),
                     "--no-dnsmos", *extra]) == 0
    ref, _ = sf.read(str(outs["onnx"] / "enhanced" / "f0.wav"), dtype="float32")
    noisy_x, _ = sf.read(str(noisy / "f0.wav"), dtype="float32")
    assert_differs(ref, noisy_x)  # the model really changed the audio
    for tag in ("stream", "ckpt", "ckpt-stream"):
        y, _ = sf.read(str(outs[tag] / "enhanced" / "f0.wav"), dtype="float32")
        assert_close_to_peak(y, ref, err_msg=tag)
    assert json.loads((outs["stream"] / "summary.json").read_text())["streaming"] is True


def test_dns_and_voicebank_layouts(tiny_onnx, tmp_path):
    test = tmp_path / "dns" / "datasets" / "test_set" / "synthetic" / "no_reverb"
    (test / "clean").mkdir(parents=True)
    (test / "noisy").mkdir(parents=True)
    for fid in (0, 1):
        x = speechlike(16000, seed=fid + 5)
        sf.write(str(test / "clean" / f"clean_fileid_{fid}.wav"), x, 16000)
        sf.write(str(test / "noisy" / f"clnsp{fid}_snr5_tl-21_fileid_{fid}.wav"), x + 0.01, 16000)
    out = tmp_path / "r1"
    assert main(["eval", "--model", str(tiny_onnx), "--dns-root", str(tmp_path / "dns"), "--out", str(out), "--no-dnsmos"]) == 0
    assert set(read_rows(out)) == {"clnsp0_snr5_tl-21_fileid_0.wav", "clnsp1_snr5_tl-21_fileid_1.wav"}

    vb = tmp_path / "vb"
    for folder in ("clean_testset_wav", "noisy_testset_wav"):
        (vb / folder).mkdir(parents=True)
        sf.write(str(vb / folder / "p232_001.wav"), speechlike(48000, 48000, seed=9), 48000)
    out = tmp_path / "r2"
    assert main(["eval", "--model", str(tiny_onnx), "--vb-root", str(vb), "--out", str(out), "--no-dnsmos"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["files"] == 1 and s["seconds"] == pytest.approx(1.0, abs=1e-3)  # scored at 16 kHz
    assert s["noisy"]["pesq_wb"] == pytest.approx(4.644, abs=0.01)


def test_attenuation_limit_of_0_db_passes_the_input_through(tiny_ckpt, tiny_onnx, tmp_path):
    """--atten-lim-db is the service's gain floor: at 0 dB no bin may be attenuated, so every path
    (offline onnx, streaming, checkpoint) gives back the noisy input and scores exactly as it."""
    noisy, clean = make_pairs(tmp_path / "d", n=1, seconds=1.5, noise=0.05)
    noisy_x, _ = sf.read(str(noisy / "f0.wav"), dtype="float32")
    for tag, model, extra in (("onnx", tiny_onnx, []), ("stream", tiny_onnx, ["--streaming"]), ("ckpt", tiny_ckpt, [])):
        out = tmp_path / tag
        assert main(["eval", "--model", str(model), "--noisy", str(noisy), "--clean", str(clean), "--out", str(out),
                     "--no-dnsmos", "--atten-lim-db", "0", *extra]) == 0
        y, _ = sf.read(str(out / "enhanced" / "f0.wav"), dtype="float32")
        assert_close_to_peak(y, noisy_x, err_msg=tag)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["atten_lim_db"] == 0.0
        assert summary["enhanced"]["pesq_wb"] == pytest.approx(summary["noisy"]["pesq_wb"], rel=1e-3)
    # without a limit the same model changes the audio (so the check above means something)
    out = tmp_path / "free"
    assert main(["eval", "--model", str(tiny_onnx), "--noisy", str(noisy), "--clean", str(clean), "--out", str(out),
                 "--no-dnsmos"]) == 0
    assert_differs(sf.read(str(out / "enhanced" / "f0.wav"), dtype="float32")[0], noisy_x)
    assert json.loads((out / "summary.json").read_text())["atten_lim_db"] is None


def test_eval_input_errors(tiny_onnx, tmp_path, capsys):
    assert main(["eval", "--model", str(tiny_onnx), "--noisy", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "noisy folder not found" in capsys.readouterr().err
    noisy, _ = make_pairs(tmp_path / "x", n=1)
    assert main(["eval", "--model", str(tmp_path / "nope.onnx"), "--noisy", str(noisy), "--out", str(tmp_path / "o")]) == 2
    assert "model not found" in capsys.readouterr().err
    assert main(["eval", "--model", str(tiny_onnx), "--noisy", str(noisy), "--out", str(tmp_path / "o"), "--no-dnsmos"]) == 2
    assert "only DNSMOS can score" in capsys.readouterr().err
    assert main(["eval", "--model", str(tiny_onnx), "--noisy", str(noisy), "--out", str(tmp_path / "o"), "--no-dnsmos",
                 "--atten-lim-db", "-3"]) == 2
    assert "atten_lim_db must be >= 0 dB" in capsys.readouterr().err


def test_oracle_is_the_ideal_gain_on_the_model_stft():
    from training.evaluation.evaluate import OracleRunner

    oracle = OracleRunner()
    x = speechlike(16000 * 2, seed=4)
    # the clean speech a fixed share of the noisy input: the gain is that share in every bin
    assert_close_to_peak(oracle(x, 0.5 * x), 0.5 * x)
    # clean louder than noisy: the gain stops at 1, the input comes back as it was
    assert_close_to_peak(oracle(x, 2.0 * x), x)
    # no noise: the clean speech comes back; silence: nothing does
    assert_close_to_peak(oracle(x, x), x)
    assert_close_to_peak(oracle(x, np.zeros_like(x)), np.zeros_like(x), plus=0.0)
    # white noise at 0 dB: the ideal gain lifts SI-SDR by far more than a model of this size would need
    noise = np.random.default_rng(5).standard_normal(len(x)).astype(np.float32) * np.std(x)
    assert si_sdr(x, oracle(x + noise, x)) > si_sdr(x, x + noise) + 8.0


def test_eval_oracle_scores_the_ideal_gain(tmp_path, capsys):
    noisy, clean = make_pairs(tmp_path / "n", n=2, noise=0.05)
    out = tmp_path / "oracle"
    assert main(["eval", "--oracle", "--noisy", str(noisy), "--clean", str(clean), "--out", str(out), "--no-dnsmos"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "oracle (ideal gain)" and summary["files"] == 2
    assert summary["enhanced"]["pesq_wb"] > summary["noisy"]["pesq_wb"] + 1.0
    rows = read_rows(out)
    assert set(rows) == {"f0.wav", "f1.wav"}
    for name, row in rows.items():
        ref, _ = sf.read(str(clean / name), dtype="float32")
        enh, _ = sf.read(str(out / "enhanced" / name), dtype="float32")
        assert float(row["enhanced_si_sdr"]) == pytest.approx(si_sdr(ref, enh), abs=1e-3)
    # errors: no clean reference, pairs out of step, with a model too
    assert main(["eval", "--oracle", "--noisy", str(noisy), "--out", str(tmp_path / "o"), "--no-dnsmos"]) == 2
    assert "--oracle needs the clean reference" in capsys.readouterr().err
    sf.write(str(clean / "f0.wav"), speechlike(16000, seed=6), 16000)
    assert main(["eval", "--oracle", "--noisy", str(noisy), "--clean", str(clean), "--out", str(tmp_path / "o"),
                 "--no-dnsmos"]) == 2
    assert "sample-aligned pairs: the clean file has 16000 samples, the noisy one 40000" in capsys.readouterr().err
    assert main(["eval", "--oracle", "--noisy", str(noisy), "--clean", str(clean), "--out", str(tmp_path / "o"),
                 "--no-dnsmos", "--streaming"]) == 2
    assert "--oracle takes neither --streaming nor --atten-lim-db" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["eval", "--oracle", "--model", "m.onnx", "--noisy", str(noisy), "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@needs_dnsmos
def test_dnsmos_prefers_clean_speech():
    from training.data.mixing import mix
    from training.evaluation.dnsmos import DNSMOS

    d = DNSMOS(DNSMOS_DIR)
    x = speechlike(int(16000 * 4.6), seed=3)  # tiled once to 9.2 s: a single 9.01 s window
    noisy, clean = mix(x, np.random.default_rng(0).standard_normal(len(x)).astype(np.float32), 5.0, -25.0)
    c, n = d.score(clean), d.score(noisy)
    assert c["bak"] > n["bak"] + 0.5 and c["ovrl"] > n["ovrl"]
    assert 1.0 <= n["bak"] <= 5.0
    assert d.windows(np.ones(16000 * 12, np.float32)).shape == (3, 144160)  # 12 s: windows at 0, 1, 2 s


@needs_dnsmos
def test_eval_without_clean_uses_dnsmos(tiny_onnx, tmp_path):
    noisy, _ = make_pairs(tmp_path / "real", n=1, seconds=4.6, noise=0.03)
    out = tmp_path / "r"
    assert main(["eval", "--model", str(tiny_onnx), "--noisy", str(noisy), "--out", str(out), "--no-audio"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert set(s["noisy"]) == {"dnsmos_sig", "dnsmos_bak", "dnsmos_ovrl"}
    assert all(1.0 <= v <= 5.0 for v in s["enhanced"].values())
    assert not (out / "enhanced").exists()


def test_subsets_by_snr_and_kind_from_dev_set_names():
    from training.evaluation.evaluate import subsets

    names = ["snr-05_music_0007.wav", "snr000_noise_0001.wav", "snr020_babble_0002.wav", "snr05_0042.wav",
             "real_p287_001.wav", "other.wav"]
    assert subsets(names) == {"-5 dB": ["snr-05_music_0007.wav"], "0 dB": ["snr000_noise_0001.wav"],
                              "5 dB": ["snr05_0042.wav"], "20 dB": ["snr020_babble_0002.wav"],
                              "noise": ["snr000_noise_0001.wav"], "music": ["snr-05_music_0007.wav"],
                              "babble": ["snr020_babble_0002.wav"], "real": ["real_p287_001.wav"]}
    assert subsets(["a.wav", "b.wav"]) == {}
