"""`enhancer` command line: denoise, export, info, bench, and the sub-commands other installed
packages add through the entry point group `enhancer.commands` (the service's `serve`).

An entry of that group is a function `add(subparsers)` that adds one sub-command whose parsed
arguments carry `fn`, the function to run; the core never imports the packages that provide them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from importlib.metadata import entry_points
from pathlib import Path

from .devices import DEVICES, providers_for
from .errors import EnhancerError


def _enhancer(model: str | None, device: str = "auto", preset: str | None = None, int8: bool = False):
    from .runtime import Enhancer

    providers = providers_for(device)
    if preset:  # random weights, for speed measurements of a preset without a trained model (needs torch)
        from . import ModelConfig, build_model
        from .export import export_step

        path = Path(tempfile.mkdtemp()) / f"{preset}{'-int8' if int8 else ''}.onnx"
        print(f"exporting preset {preset} with random weights{' (int8)' if int8 else ''} to {path}", file=sys.stderr,
              flush=True)
        export_step(build_model(ModelConfig.preset(preset)).eval(), path, check=False, int8_weights=int8)
        model = str(path)
    return Enhancer.from_pretrained(model, providers=providers)


def cmd_denoise(a) -> int:
    from tqdm import tqdm

    from .audio_io import enhance_file, find_audio

    enh = _enhancer(a.model, a.device)
    files = find_audio([Path(p) for p in a.inputs])
    if not files:
        raise EnhancerError("no audio files found in the inputs")
    out = Path(a.output)
    single_file = len(a.inputs) == 1 and Path(a.inputs[0]).is_file() and out.suffix and not out.is_dir()
    import soundfile as sf

    total = 0
    for src, _ in files:
        try:
            total += sf.info(str(src)).frames
        except (sf.LibsndfileError, RuntimeError):
            pass
    failed = 0
    with tqdm(total=total, unit="sample", unit_scale=True, disable=a.quiet, desc="denoise") as bar:
        for src, rel in files:
            dst = out if single_file else out / rel
            try:
                enhance_file(enh, src, dst, a.atten_lim_db, progress=bar.update)
            except EnhancerError as e:
                failed += 1
                tqdm.write(f"error: {e}", file=sys.stderr)
    n_ok = len(files) - failed
    if not a.quiet:
        print(f"{n_ok} file(s) written to {out}" + (f", {failed} failed" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


def cmd_export(a) -> int:
    from .checkpoint import load_checkpoint, save_checkpoint
    from .export import MAX_REL_DIFF, export_step, round_to_fp16
    from .quantize import MIN_PARITY_SNR_DB

    if not a.quiet:
        print(f"loading {a.checkpoint}", file=sys.stderr, flush=True)
    model = load_checkpoint(a.checkpoint)
    if a.fp16:
        round_to_fp16(model)
    report = export_step(model, a.output, check=not a.no_check, verbose=not a.quiet, fp16_weights=a.fp16,
                         int8_weights=a.int8)
    if a.save_checkpoint:  # weights only (no training state), e.g. the shipped models/tim.pt
        report["checkpoint"] = str(save_checkpoint(model, model.config, a.save_checkpoint, half=a.fp16))
    print(json.dumps(report, indent=2))
    if a.int8 and "parity_snr_db" in report and report["parity_snr_db"] < MIN_PARITY_SNR_DB:
        print(f"error: the int8 graph's output is only {report['parity_snr_db']:.1f} dB above its difference from "
              f"torch (needs {MIN_PARITY_SNR_DB:g} dB)", file=sys.stderr)
        return 1
    if not a.int8 and "max_rel_diff" in report and not report["max_rel_diff"] <= MAX_REL_DIFF:
        print(f"error: onnxruntime differs from torch by {report['max_abs_diff']:.3g}, "
              f"{report['max_rel_diff']:.3g} of the output's peak (allowed: {MAX_REL_DIFF:g})", file=sys.stderr)
        return 1
    return 0


def cmd_info(a) -> int:
    path = Path(a.model) if a.model else None
    if path is not None and path.suffix in (".pt", ".ckpt", ".pth"):
        from .checkpoint import load_checkpoint
        from .model import count_parameters

        model = load_checkpoint(path)
        cfg, params, extra = model.config, count_parameters(model), {"versions": model.checkpoint.get("versions")}
    elif path is None and a.preset:
        from . import ModelConfig, build_model
        from .model import count_parameters

        cfg = ModelConfig.preset(a.preset)
        params, extra = count_parameters(build_model(cfg)), {}
    else:
        enh = _enhancer(a.model)
        cfg, params, extra = enh.config, enh.engine.parameters, {"provider": enh.provider, "file": str(enh.engine.path),
                                                       "weights": enh.engine.weights}
    info = {
        "preset": cfg.name, "parameters": params, "algorithmic_latency_ms": cfg.algorithmic_latency_ms,
        "stream_delay_samples_16k": cfg.delay_samples, "lookahead_frames": cfg.lookahead,
        "attention_window_frames": cfg.attention_window, **extra, "config": cfg.to_dict(),
    }
    print(json.dumps(info, indent=2))
    return 0


def cmd_bench(a) -> int:
    from .bench import main as bench_main

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.int8 and not a.preset:
        print("error: --int8 applies to --preset (a model file is benchmarked as it is; export one with "
              "`enhancer export CKPT -o MODEL.onnx --int8`)", file=sys.stderr)
        return 2
    return bench_main(_enhancer(a.model, "cpu" if a.device == "auto" else a.device, a.preset, a.int8), as_json=a.json,
                      steps=a.steps)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="enhancer", description="Real-time speech enhancement (TIM).")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("denoise", help="enhance audio files or folders")
    d.add_argument("inputs", nargs="+", help="audio files or folders (any format libsndfile reads)")
    d.add_argument("-o", "--output", required=True, help="output file (one input file) or folder")
    d.add_argument("--atten-lim-db", type=float, default=None, help="limit noise attenuation to this many dB")
    d.add_argument("--model", default=None, help="exported .onnx model (default: the shipped one)")
    d.add_argument("--device", choices=DEVICES, default="auto")
    d.add_argument("-q", "--quiet", action="store_true")
    d.set_defaults(fn=cmd_denoise)

    e = sub.add_parser("export", help="export a checkpoint's streaming step graph to ONNX")
    e.add_argument("checkpoint")
    e.add_argument("-o", "--output", required=True)
    e.add_argument("--no-check", action="store_true", help="skip onnx.checker and the onnxruntime/torch comparison")
    e.add_argument("--fp16", action="store_true", help="store weights as float16 (half the size; computed in float32)")
    e.add_argument("--int8", action="store_true",
                   help="dense weights as 8-bit blocks (onnxruntime MatMulNBits): faster steps at small batches, "
                        "not bit-exact (checked: output >= 30 dB above its difference from torch)")
    e.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr (the JSON report still goes to stdout)")
    e.add_argument("--save-checkpoint", default=None, metavar="PT",
                   help="also write the exported weights as a torch checkpoint without training state")
    e.set_defaults(fn=cmd_export)

    i = sub.add_parser("info", help="config, parameters and latency of a model")
    i.add_argument("model", nargs="?", default=None, help=".onnx or checkpoint (default: the shipped model)")
    i.add_argument("--preset", default=None, help="describe a preset instead of a file (needs torch)")
    i.set_defaults(fn=cmd_info)

    b = sub.add_parser("bench", help="step latency, throughput, real-time factor, memory")
    b.add_argument("--model", default=None)
    b.add_argument("--preset", default=None, help="benchmark a preset with random weights (needs torch)")
    b.add_argument("--device", choices=DEVICES, default="auto")
    b.add_argument("--steps", type=int, default=300)
    b.add_argument("--int8", action="store_true", help="with --preset: export it with 8-bit weights (export --int8)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=cmd_bench)
    add_plugin_commands(sub)
    return p


COMMANDS_GROUP = "enhancer.commands"


def add_plugin_commands(sub) -> None:
    """The sub-commands of installed packages (entry point group `enhancer.commands`), by name. One
    that cannot load is listed with the reason and fails with it when called."""
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            add = ep.load()
        except ImportError as e:
            _unavailable(sub, ep.name, f"{type(e).__name__}: {e}")
            continue
        add(sub)


def _unavailable(sub, name: str, reason: str) -> None:
    # no option characters: whatever follows the name is taken as is, to fail with the reason
    p = sub.add_parser(name, help=f"(not available here: {reason})", add_help=False, prefix_chars="\0")
    p.add_argument("args", nargs="*")

    def fail(_a) -> int:
        raise EnhancerError(f"`enhancer {name}` cannot run here: {reason}")

    p.set_defaults(fn=fail)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except (EnhancerError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
