"""Command line: export, info, denoise (files, folders, formats), bad input."""
import json

import numpy as np
import pytest
import soundfile as sf
import torch

import enhancer
from enhancer.build.export import MAX_REL_DIFF
from enhancer.cli import main
from enhancer.runtime import Enhancer
from tests.conftest import broken_audio, core_message, speechlike
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
    assert main(["info", str(model_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["preset"] == "tim" and info["algorithmic_latency_ms"] == 64.0
    assert info["parameters"] == 6987947 and info["provider"] == "CPUExecutionProvider"
    assert info["stream_state"] == "host" and "CPUExecutionProvider" in info["available_providers"]
    assert main(["info", str(model_path), "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["provider"] == "CPUExecutionProvider"


def test_bench_batches_are_chosen_and_checked(model_path, capsys):
    assert main(["bench", "--model", str(model_path), "--steps", "4", "--batches", "2,3", "--seconds", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [s["batch"] for s in res["step"]] == [2, 3] and res["device"] == "cpu" and "streams_per_gpu" not in res
    for bad in ("0,4", "two", ""):
        with pytest.raises(SystemExit):
            main(["bench", "--model", str(model_path), "--batches", bad])
        assert "--batches" in capsys.readouterr().err
    for bad in ("0", "-1", "4000"):
        assert main(["bench", "--model", str(model_path), "--seconds", bad]) == 2
        assert "--seconds must be above 0" in capsys.readouterr().err


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
    assert "broken.wav: the audio file is malformed or truncated" in capsys.readouterr().err


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
    assert main(["bench", "--model", str(model_path), "--steps", "8", "--seconds", "2", "--json"]) == 0
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
    assert res["weights"] == "fp32" and res["rings"] == "float32"  # how the graph stores them
    assert res["offline_rtf"] > 0 and res["peak_rss_mb"] > 0
    assert [r["frames"] for r in res["offline"]] == [1, 16, 32, 64, 128, 256]
    assert all(r["rtf"] > 0 and r["rtf_cpu"] > 0 for r in res["offline"])
    assert res["offline_best_frames"] in [r["frames"] for r in res["offline"]]
    # the capacity advice follows the measurement on this machine
    searched = {s["batch"]: s["p99_ms"] for s in res["search"]}
    n = res["streams_per_core"]
    assert n == 0 or searched[n] <= 16.0  # found by search: within the hop ...
    assert n == 1024 or searched[n + 1] > 16.0  # ... and the next batch is not (or the search's limit)
    assert res["suggested_workers"] == res["cores"] >= 1
    assert res["suggested_max_streams"] == int(2 / 3 * res["streams_per_core"] * res["cores"])



def test_bench_two_models_in_one_run_interleaved(model_path, capsys):
    """`--model A --model B`: both measured in the same run (JSON: one result per model, in order)
    and, as text, a comparison row per model."""
    assert main(["bench", "--model", str(model_path), "--model", str(model_path), "--steps", "4", "--seconds", "1",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert isinstance(res, list) and [r["model"] for r in res] == [str(model_path)] * 2
    for r in res:
        assert [s["batch"] for s in r["step"]] == [1, 4, 16, 32, 64] and r["offline_rtf_cpu"] > 0
    from enhancer.bench import format_comparison

    text = format_comparison(res)
    assert text.count(str(model_path)) == 2 and "streams/core" in text

def test_the_search_finds_the_largest_real_time_batch_exactly():
    from enhancer.bench import largest_realtime_batch

    calls = []

    def p99(b):  # 2 ms of overhead + 0.3 ms per stream: 46 streams fit in 16 ms, 47 do not
        calls.append(b)
        return 2.0 + 0.3 * b

    n, seen = largest_realtime_batch(p99, 16.0, start=16)
    assert n == 46 and seen[46] <= 16.0 < seen[47]
    assert len(calls) == len(set(calls)) <= 10  # each batch timed once, a handful of probes
    assert largest_realtime_batch(p99, 16.0, start=64)[0] == 46  # a start over the budget bisects down
    assert largest_realtime_batch(p99, 1.0)[0] == 0
    assert largest_realtime_batch(lambda b: 1.0, 16.0, limit=100)[0] == 100


def test_two_models_search_their_real_time_batch_in_turns(model_path, monkeypatch):
    """`run_many` times one batch of each model's search at a time (a slower machine for a while
    weighs on both), and each search still ends at its own model's largest real-time batch."""
    from enhancer import bench

    fast, slow = (Enhancer.from_pretrained(model_path, providers=["CPUExecutionProvider"]) for _ in range(2))
    per_stream = {id(fast): 0.3, id(slow): 0.6}  # 2 ms + this per stream: 46 and 23 streams fit in 16 ms
    order = []

    def fake_time_steps(enh, batch, steps, pace_s=0.0, **pool):
        order.append((id(enh), batch))
        return np.full(steps, 2.0 + per_stream[id(enh)] * batch)

    monkeypatch.setattr(bench, "time_steps", fake_time_steps)
    res = bench.run_many([fast, slow], steps=60, batches=(1, 4), seconds=0.5)
    assert [r["streams_per_core"] for r in res] == [46, 23]
    searched = order[2 * 2 + 2 * len(bench.PACED_BATCHES):]  # after the batch sizes and the paced stages
    whose = [m for m, _ in searched]
    both = min(len(r["search"]) for r in res)  # probes each search made while the other still ran
    assert both >= 3 and all(whose[k] != whose[k + 1] for k in range(2 * both - 1))  # alternating
    for r, m in zip(res, (fast, slow), strict=True):
        assert {s["batch"] for s in r["search"]} <= {b for mm, b in searched if mm == id(m)}


def test_export_check_runs_lanes_at_different_positions_and_sees_a_mismatch(torch_model, model_path):
    from enhancer.build.export import compare_with_torch
    from enhancer.build.model import StreamingStep

    w = torch_model.config.attention_window
    n = 3 * w + 8
    r = compare_with_torch(StreamingStep(torch_model).eval(), model_path, batch=3, n_steps=n)
    s = w // 3 + 1
    assert r["positions"] == [n, n - s, n - 2 * s] and min(r["positions"]) > w  # all wrapped, at different slots
    from enhancer.build.export import split_at

    assert split_at([1, 3, 1, 64], [0, 6, 12]) == [1, 3, 1, 1, 6, 57]
    assert r["max_rel_diff"] <= MAX_REL_DIFF and r["parity_snr_db"] > 60
    torch.manual_seed(1)  # the same architecture with other weights: the check must see it
    other = enhancer.build_model(torch_model.config).eval()
    other.set_normalization(torch_model.feat_mean.clone(), torch_model.feat_std.clone())
    bad = compare_with_torch(StreamingStep(other).eval(), model_path, batch=3, n_steps=n)
    assert bad["max_rel_diff"] > 100 * MAX_REL_DIFF and bad["parity_snr_db"] < 20


def test_export_fails_when_onnxruntime_is_off_by_more_than_the_gate(tmp_path, monkeypatch, capsys):
    import enhancer.build.export as ex

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


# ---------------------------------------------------------------------------- the command line's contract (issue 43)
def _tone(path, n=6000, sr=16000, **kw):
    sf.write(path, speechlike(n, sr=sr), sr, **kw)
    return path


def test_denoise_output_format_follows_the_extension_or_format(tmp_path, model_path, capsys):
    """`-o y.mp3` writes MP3 (not WAV bytes under an .mp3 name); --format picks the container as
    REST's `format` does and must agree with a file name; an unknown extension lists the known ones."""
    src = _tone(tmp_path / "in.wav")
    for ext, fmt in [("mp3", "MP3"), ("flac", "FLAC"), ("ogg", "OGG"), ("wav", "WAV")]:
        dst = tmp_path / f"y.{ext}"
        assert main(["denoise", str(src), "-o", str(dst), "--model", str(model_path), "-q"]) == 0
        info = sf.info(dst)
        assert info.format == fmt and info.samplerate == 16000 and info.channels == 1
        assert abs(info.frames - 6000) <= (2 * 1152 if fmt == "MP3" else 0)
    assert sf.info(tmp_path / "y.flac").subtype == "PCM_16"  # the input's subtype where the container allows it
    _tone(tmp_path / "in.aiff", format="AIFF")  # a container outside REST's list: only as the input's own
    assert main(["denoise", str(tmp_path / "in.aiff"), "-o", str(tmp_path / "y.aiff"), "--model", str(model_path),
                 "-q"]) == 0
    assert sf.info(tmp_path / "y.aiff").format == "AIFF"
    capsys.readouterr()

    assert main(["denoise", str(src), "-o", str(tmp_path / "y.xyz"), "--model", str(model_path), "-q"]) != 0
    err = capsys.readouterr().err
    assert "cannot tell the output format from the extension .xyz; use one of .wav, .flac, .ogg, .mp3" in err
    assert not (tmp_path / "y.xyz").exists() and not list(tmp_path.glob("*.part"))
    assert main(["denoise", str(src), "-o", str(tmp_path / "z.wav"), "--format", "flac", "--model",
                 str(model_path), "-q"]) != 0
    assert "the extension .wav does not match the format asked for (flac)" in capsys.readouterr().err
    assert not (tmp_path / "z.wav").exists()
    assert main(["denoise", str(src), "-o", str(tmp_path / "z.flac"), "--format", "flac", "--model",
                 str(model_path), "-q"]) == 0
    assert sf.info(tmp_path / "z.flac").format == "FLAC"
    with pytest.raises(SystemExit):  # not one of REST's formats: argparse refuses it
        main(["denoise", str(src), "-o", str(tmp_path / "z.aiff"), "--format", "aiff"])
    # into a folder: --format gives every file its container and extension
    (tmp_path / "many").mkdir()
    _tone(tmp_path / "many" / "a.wav")
    _tone(tmp_path / "many" / "b.flac", format="FLAC")
    assert main(["denoise", str(tmp_path / "many"), "-o", str(tmp_path / "out"), "--format", "ogg",
                 "--model", str(model_path), "-q"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.ogg", "b.ogg"]
    assert {sf.info(p).format for p in (tmp_path / "out").iterdir()} == {"OGG"}


def test_broken_input_fails_with_the_readers_message_and_no_output(tmp_path, model_path, capsys):
    """A truncated WAV is an error, not a shorter result; each broken file gives one line on stderr
    with the reader's message (REST answers with the same one, tests/server/test_rest.py), a
    non-zero exit and nothing written."""
    for name, data in broken_audio().items():
        src = tmp_path / name
        src.write_bytes(data)
        dst = tmp_path / f"out-{name}"
        assert main(["denoise", str(src), "-o", str(dst), "--model", str(model_path), "-q"]) != 0, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {src}: "), err
        assert not dst.exists() and not list(tmp_path.glob("*.part")), name
        assert err.removeprefix(f"error: {src}: ").strip() == core_message(data), name


def test_broken_input_in_a_subprocess_prints_one_line_and_no_traceback(tmp_path, model_path):
    import subprocess
    import sys

    src = tmp_path / "truncated.wav"
    src.write_bytes(broken_audio()["truncated.wav"])
    r = subprocess.run([sys.executable, "-m", "enhancer", "denoise", str(src), "-o", str(tmp_path / "o.wav"),
                        "--model", str(model_path), "-q"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (f"error: {src}: the WAV file is truncated: its header promises more audio data "
                                "than the file holds")
    assert not (tmp_path / "o.wav").exists()


def test_several_inputs_need_a_folder(tmp_path, model_path, capsys):
    a, b = _tone(tmp_path / "a.wav"), _tone(tmp_path / "b.wav")
    single = tmp_path / "single.wav"
    assert main(["denoise", str(a), str(b), "-o", str(single), "--model", str(model_path), "-q"]) == 2
    assert "-o " + str(single) + " names a file; with several inputs (or a folder) -o must be a folder" in \
           capsys.readouterr().err
    assert not single.exists()  # no folder named single.wav
    (tmp_path / "d").mkdir()
    _tone(tmp_path / "d" / "c.wav")
    assert main(["denoise", str(tmp_path / "d"), "-o", str(single), "--model", str(model_path), "-q"]) == 2
    assert not single.exists()
    existing = _tone(tmp_path / "existing.flac", format="FLAC")
    assert main(["denoise", str(a), str(b), "-o", str(existing), "--model", str(model_path), "-q"]) == 2
    assert "is a file; with several inputs" in capsys.readouterr().err
    (tmp_path / "e").mkdir()
    _tone(tmp_path / "e" / "a.wav")  # two inputs named a.wav: one would overwrite the other
    assert main(["denoise", str(a), str(tmp_path / "e"), "-o", str(tmp_path / "o"), "--model", str(model_path),
                 "-q"]) == 2
    assert "would both be written to" in capsys.readouterr().err
    assert main(["denoise", str(a), str(b), "-o", str(tmp_path / "o"), "--model", str(model_path), "-q"]) == 0
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["a.wav", "b.wav"]
    # one input file into an existing folder, or a name without extension: the folder
    assert main(["denoise", str(a), "-o", str(tmp_path / "d"), "--model", str(model_path), "-q"]) == 0
    assert sf.info(tmp_path / "d" / "a.wav").frames == 6000


@pytest.mark.filterwarnings("ignore:Specified provider .CUDAExecutionProvider.")
def test_device_cuda_without_cuda_is_an_error_as_in_serve(tmp_path, model_path, monkeypatch, capsys):
    import enhancer.devices as devices

    src = _tone(tmp_path / "a.wav")
    monkeypatch.setattr(devices, "available_providers", lambda: ["CPUExecutionProvider"])
    for argv in (["denoise", str(src), "-o", str(tmp_path / "o.wav"), "--model", str(model_path), "-q",
                  "--device", "cuda"], ["bench", "--model", str(model_path), "--device", "cuda", "--steps", "1"]):
        assert main(argv) == 2
        assert capsys.readouterr().err == ("error: device 'cuda' requested but onnxruntime has no CUDAExecutionProvider "
                                           "(install the [gpu] extra on a machine with CUDA)\n")
    assert not (tmp_path / "o.wav").exists()
    # CUDA listed but the session could not start it (onnxruntime falls back to the CPU): refused too
    monkeypatch.setattr(devices, "available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert main(["denoise", str(src), "-o", str(tmp_path / "o.wav"), "--model", str(model_path), "-q",
                 "--device", "cuda"]) == 2
    assert "device 'cuda' requested but the model runs on CPUExecutionProvider" in capsys.readouterr().err
    assert not (tmp_path / "o.wav").exists()
    assert main(["denoise", str(src), "-o", str(tmp_path / "o.wav"), "--model", str(model_path), "-q",
                 "--device", "cpu"]) == 0


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"enhancer {enhancer.__version__} (tim-enhancer)")
    assert "model tim.onnx: tim" in out  # the shipped model, with the version that exported it


def test_every_option_has_help_text():
    import argparse

    from enhancer.cli import build_parser

    def parsers(p, path):
        yield path, p
        for act in p._actions:
            if isinstance(act, argparse._SubParsersAction):
                for name, sub in act.choices.items():
                    yield from parsers(sub, f"{path} {name}")

    missing = []
    for path, p in parsers(build_parser(), "enhancer"):
        if not p.add_help:  # a plug-in command that cannot load here (only its reason)
            continue
        for act in p._actions:
            if isinstance(act, argparse._SubParsersAction):
                missing += [f"{path} {c.dest}" for c in act._choices_actions if not c.help]
            elif not act.help:
                missing.append(f"{path} {'/'.join(act.option_strings) or act.dest}")
    assert not missing, missing


def test_info_prints_a_summary_for_people_and_json_on_request(model_path, capsys):
    assert main(["info", str(model_path)]) == 0
    out = capsys.readouterr().out
    rows = dict(line.split(None, 1) if not line.startswith(("sample rate", "frame / hop")) else
                (line[:11].strip(), line[11:].strip()) for line in out.splitlines() if line and not line.startswith("("))
    assert rows["model"].startswith("tim, 6.99 M parameters")
    assert rows["sample rate"].startswith("16000 Hz")
    assert rows["latency"].startswith("64 ms algorithmic")
    assert rows["frame / hop"].startswith("512 / 256 samples (32 / 16 ms)")
    assert rows["provider"].startswith("CPUExecutionProvider (available: ")
    assert rows["threads"].startswith("1 ")
    assert rows["version"].startswith(f"tim-enhancer {enhancer.__version__}")
    assert not out.lstrip().startswith("{")
    assert main(["info", str(model_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["preset"] == "tim"


def test_a_command_that_needs_torch_says_so_in_one_line_without_it(monkeypatch, capsys):
    def no_torch(cfg):  # what build_model raises in an install without the [train] extra
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(enhancer, "build_model", no_torch)
    assert main(["info", "--preset", "tim"]) == 2
    assert capsys.readouterr().err == ("error: this command needs the module 'torch', which is not installed here "
                                       "(pip install 'tim-enhancer[train]')\n")
