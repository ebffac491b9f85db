"""Command line: export, info, denoise (files, folders, formats), bad input."""
import json

import numpy as np
import pytest
import soundfile as sf
import torch

import enhancer
from enhancer.cli import main
from enhancer.export import MAX_REL_DIFF
from enhancer.runtime import Enhancer
from tests.conftest import speechlike
from tests.tolerance import assert_close_to_peak, assert_differs


@pytest.mark.parametrize("preset", ["baseline", "tim-nocomp", "tim4", "tim-lowlatency"])
def test_export_every_variant_matches_torch(tmp_path, preset, capsys):
    torch.manual_seed(0)
    cfg = enhancer.ModelConfig.preset(preset, attention_window=8)
    ckpt = enhancer.save_checkpoint(enhancer.build_model(cfg).eval(), cfg, tmp_path / "m.pt")
    assert main(["export", str(ckpt), "-o", str(tmp_path / "m.onnx")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["max_rel_diff"] <= MAX_REL_DIFF  # over 2 windows + 8 steps: the rings wrap around
    enh = Enhancer.from_pretrained(tmp_path / "m.onnx")
    assert enh.config == cfg
    x = speechlike(4000)
    ref = enhancer.load_checkpoint(ckpt).enhance(torch.from_numpy(x)[None])[0].numpy()
    assert_close_to_peak(enh.enhance(x, 16000), ref)


def test_info_reads_the_onnx_metadata(model_path, capsys):
    assert main(["info", str(model_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["preset"] == "tim" and info["algorithmic_latency_ms"] == 64.0
    assert info["parameters"] == 6987947 and info["provider"] == "CPUExecutionProvider"


@pytest.mark.parametrize("fmt, subtype, rate, channels", [
    ("WAV", "PCM_16", 16000, 1), ("FLAC", "PCM_24", 44100, 2), ("OGG", "VORBIS", 48000, 1), ("WAV", "FLOAT", 8000, 2),
])
def test_denoise_keeps_format_rate_channels_length(tmp_path, model_path, enhancer_rt, fmt, subtype, rate, channels):
    x = speechlike(int(0.6 * rate), sr=rate, seed=3, channels=channels if channels > 1 else 0)
    ext = {"WAV": "wav", "FLAC": "flac", "OGG": "ogg"}[fmt]
    src = tmp_path / f"in.{ext}"
    sf.write(src, x, rate, subtype=subtype, format=fmt)
    dst = tmp_path / f"out.{ext}"
    assert main(["denoise", str(src), "-o", str(dst), "--model", str(model_path), "-q"]) == 0
    info_in, info_out = sf.info(src), sf.info(dst)
    assert (info_out.format, info_out.subtype, info_out.samplerate, info_out.channels, info_out.frames) == \
           (info_in.format, info_in.subtype, info_in.samplerate, info_in.channels, info_in.frames)
    if fmt != "OGG":  # lossless: the file holds what enhance returns for the decoded input
        decoded, _ = sf.read(src, dtype="float32")
        got, _ = sf.read(dst, dtype="float32")
        ref = np.clip(enhancer_rt.enhance(decoded, rate), -1, 1)
        step = {"FLOAT": 0.0, "PCM_16": 1.01 / 2 ** 15, "PCM_24": 1.01 / 2 ** 23}[subtype]  # one quantisation step
        assert_close_to_peak(got, ref, plus=step)


def test_denoise_folder_and_bad_files(tmp_path, model_path, capsys):
    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    sf.write(src / "a.wav", speechlike(5000), 16000)
    sf.write(src / "sub" / "b.flac", speechlike(7000, seed=1), 16000)
    (src / "broken.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk")
    (src / "notes.txt").write_text("not audio")
    out = tmp_path / "out"
    code = main(["denoise", str(src), "-o", str(out), "--model", str(model_path), "-q"])
    assert code == 1  # one file failed, the others are written
    assert sf.info(out / "a.wav").frames == 5000
    assert sf.info(out / "sub" / "b.flac").frames == 7000
    assert not (out / "broken.wav").exists() and not list(out.rglob("*.part"))
    assert "broken.wav: not readable audio" in capsys.readouterr().err


def test_denoise_missing_input(tmp_path, model_path, capsys):
    assert main(["denoise", str(tmp_path / "nope.wav"), "-o", str(tmp_path / "o.wav"), "--model", str(model_path)]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_fp16_export_is_exact_and_half_the_size(tmp_path, torch_model, capsys):
    ckpt = enhancer.save_checkpoint(torch_model, torch_model.config, tmp_path / "m.pt")
    assert main(["export", str(ckpt), "-o", str(tmp_path / "m32.onnx")]) == 0
    assert main(["export", str(ckpt), "-o", str(tmp_path / "m16.onnx"), "--fp16", "--save-checkpoint", str(tmp_path / "ship.pt")]) == 0
    size32, size16 = (tmp_path / "m32.onnx").stat().st_size, (tmp_path / "m16.onnx").stat().st_size
    assert size16 < 0.55 * size32
    assert (tmp_path / "ship.pt").stat().st_size < 0.55 * ckpt.stat().st_size
    shipped = enhancer.load_checkpoint(tmp_path / "ship.pt")  # float32 again, float16 values
    x = speechlike(5000, seed=7)
    ref = shipped.enhance(torch.from_numpy(x)[None])[0].numpy()
    got = Enhancer.from_pretrained(tmp_path / "m16.onnx").enhance(x, 16000)
    assert_close_to_peak(got, ref)
    full = Enhancer.from_pretrained(tmp_path / "m32.onnx").enhance(x, 16000)
    assert_differs(got, full, 1e-6)  # rounding the weights changes the output ...
    assert_close_to_peak(got, full, 0.02)  # ... a little


def test_bench_json_reports_every_batch_and_the_paced_steps(model_path, capsys):
    assert main(["bench", "--model", str(model_path), "--steps", "8", "--json"]) == 0
    captured = capsys.readouterr()
    res = json.loads(captured.out)
    assert "timing the step graph" in captured.err  # it says what it is doing (stderr; stdout stays JSON)
    assert [s["batch"] for s in res["step"]] == [1, 4, 16, 32, 64]
    assert [s["batch"] for s in res["paced"]] == [1, 16]
    for s in res["step"] + res["paced"]:
        assert 0 < s["p50_ms"] <= s["p99_ms"]
    for s in res["step"]:
        assert s["per_stream_p50_ms"] == pytest.approx(s["p50_ms"] / s["batch"])
    assert res["algorithmic_latency_ms"] == 64 and res["provider"] == "CPUExecutionProvider"
    assert res["offline_rtf"] > 0 and res["peak_rss_mb"] > 0
    assert [r["frames"] for r in res["offline"]] == [1, 16, 32, 64, 128, 256]
    assert all(r["rtf"] > 0 and r["rtf_cpu"] > 0 for r in res["offline"])
    assert res["offline_best_frames"] in [r["frames"] for r in res["offline"]]
    # the capacity advice follows the measurement on this machine
    real = [s["batch"] for s in res["step"] if s["realtime"]]
    assert res["streams_per_core"] == (max(real) if real else 0)
    assert res["suggested_workers"] == res["cores"] >= 1
    assert res["suggested_max_streams"] == int(2 / 3 * res["streams_per_core"] * res["cores"])


def test_export_check_runs_lanes_at_different_positions_and_sees_a_mismatch(torch_model, model_path):
    from enhancer.export import compare_with_torch
    from enhancer.model import StreamingStep

    w = torch_model.config.attention_window
    n = 3 * w + 8
    r = compare_with_torch(StreamingStep(torch_model).eval(), model_path, batch=3, n_steps=n)
    s = w // 3 + 1
    assert r["positions"] == [n, n - s, n - 2 * s] and min(r["positions"]) > w  # all wrapped, at different slots
    from enhancer.export import split_at

    assert split_at([1, 3, 1, 64], [0, 6, 12]) == [1, 3, 1, 1, 6, 57]
    assert r["max_rel_diff"] <= MAX_REL_DIFF and r["parity_snr_db"] > 60
    torch.manual_seed(1)  # the same architecture with other weights: the check must see it
    other = enhancer.build_model(torch_model.config).eval()
    other.set_normalization(torch_model.feat_mean.clone(), torch_model.feat_std.clone())
    bad = compare_with_torch(StreamingStep(other).eval(), model_path, batch=3, n_steps=n)
    assert bad["max_rel_diff"] > 100 * MAX_REL_DIFF and bad["parity_snr_db"] < 20


def test_export_fails_when_onnxruntime_is_off_by_more_than_the_gate(tmp_path, monkeypatch, capsys):
    import enhancer.export as ex

    cfg = enhancer.ModelConfig.preset("baseline", attention_window=8)
    ckpt = enhancer.save_checkpoint(enhancer.build_model(cfg).eval(), cfg, tmp_path / "m.pt")
    real = ex.compare_with_torch

    def off(*args, **kwargs):  # what a slightly wrong graph reports: just over the gate, relative to the peak
        r = real(*args, **kwargs)
        return r | {"max_abs_diff": 0.5, "max_rel_diff": 2 * MAX_REL_DIFF}

    monkeypatch.setattr(ex, "compare_with_torch", off)
    assert main(["export", str(ckpt), "-o", str(tmp_path / "m.onnx")]) == 1
    err = capsys.readouterr().err
    assert "comparing onnxruntime with torch" in err  # it says what it is doing
    assert "of the output's peak (allowed: 0.0001)" in err


def test_commands_of_other_packages_come_from_entry_points(monkeypatch, capsys):
    """`enhancer` lists the sub-commands of the entry point group `enhancer.commands` (the service's
    `serve`) without importing their packages itself; one that cannot load says why when called."""
    import enhancer.cli as cli

    class Broken:
        name = "broken"

        def load(self):
            raise ImportError("No module named 'uvicorn'")

    real = cli.entry_points
    assert [ep.value for ep in real(group=cli.COMMANDS_GROUP) if ep.name == "serve"] == ["server.cli:add_serve"]
    monkeypatch.setattr(cli, "entry_points", lambda group: [*real(group=group), Broken()])
    assert main(["broken", "--anything"]) == 2
    assert "`enhancer broken` cannot run here: ImportError: No module named 'uvicorn'" in capsys.readouterr().err
    assert "serve" in cli.build_parser().format_help()
