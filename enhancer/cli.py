"""`enhancer` command line: denoise, export, stream, info, bench, and the sub-commands other installed
packages add through the entry point group `enhancer.commands` (the service's `serve`).

An entry of that group is a function `add(subparsers)` that adds one sub-command whose parsed
arguments carry `fn`, the function to run; the core never imports the packages that provide them.

This command is where the package reads its environment (`environment_defaults`, `ENVIRONMENT`):
$TIM_ENHANCER_MODEL, $TIM_ENHANCER_FULL_STEPS and $TIM_ENHANCER_DEVICE_POOL give the defaults of
the flags `--model`, `--full-steps` and `--device-pool`, of every sub-command that has them (those of
other packages too, when their default is None); the runtime itself takes them as arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from importlib.metadata import entry_points
from pathlib import Path

from .devices import DEVICES, check_device, providers_for
from .errors import EnhancerError
from .version import __version__

TRAIN_MODULES = ("torch", "onnx", "onnx_ir", "scipy", "pesq", "pystoi", "matplotlib")  # the [train] extra
LEVEL_HELP = ("model (default): the model's output as it is; input: the voice given back at the input's speech "
              "level (the model returns it a few dB quieter)")
THREADS = 1  # onnxruntime intra-op threads of the command line's session (the service's too)
# the environment variables of the package: read here, at the command line, and nowhere in the runtime
MODEL_ENV = "TIM_ENHANCER_MODEL"
FULL_STEPS_ENV = "TIM_ENHANCER_FULL_STEPS"
DEVICE_POOL_ENV = "TIM_ENHANCER_DEVICE_POOL"
ENVIRONMENT = f"""environment (the defaults of these flags, in every sub-command that has them):
  {MODEL_ENV}=PATH      --model: the model to load (else the shipped one)
  {FULL_STEPS_ENV}=1    --full-steps: live steps of the whole pool through a static graph (a CUDA graph under CUDA)
  {DEVICE_POOL_ENV}=1   --device-pool: stream state in the device pool on the CPU too (a rehearsal of the GPU's path)"""


def environment_defaults(env=None) -> dict:
    """The flag defaults the environment `env` (default: this process's) gives, by argument name:
    model (a path or None), full_steps and device_pool (True when the variable is "1")."""
    env = os.environ if env is None else env
    return {"model": env.get(MODEL_ENV) or None, "full_steps": env.get(FULL_STEPS_ENV) == "1",
            "device_pool": env.get(DEVICE_POOL_ENV) == "1"}


def _enhancer(model: str | None, device: str = "auto", preset: str | None = None, int8: bool = False):
    from .runtime import Enhancer

    providers = providers_for(device)
    check_device(device)  # `cuda` without CUDA is an error, as in `enhancer serve`, not a silent CPU run
    if preset:  # random weights, for speed measurements of a preset without a trained model (needs torch)
        from . import ModelConfig, build_model
        from .build.export import export_step

        path = Path(tempfile.mkdtemp()) / f"{preset}{'-int8' if int8 else ''}.onnx"
        print(f"exporting preset {preset} with random weights{' (int8)' if int8 else ''} to {path}", file=sys.stderr,
              flush=True)
        export_step(build_model(ModelConfig.preset(preset)).eval(), path, check=False, int8_weights=int8)
        model = str(path)
    enh = Enhancer.from_pretrained(model, providers=providers, threads=THREADS)
    check_device(device, enh.provider)  # CUDA listed but failed to start: refuse too
    return enh


def output_paths(inputs: list[str], files: list[tuple[Path, Path]], output: str, fmt: str | None) -> list[Path]:
    """Where each input file goes. One input file: `output` itself, unless it is a folder (an
    existing one, or a name without extension); several inputs or a folder: `output` must be a
    folder, and the files keep their paths below their input (the extension of `fmt` if given)."""
    from .audio_io import audio_extensions

    out = Path(output)
    rels = [rel.with_suffix(f".{fmt}") if fmt else rel for _, rel in files]
    if len(inputs) == 1 and Path(inputs[0]).is_file():
        return [out / rels[0] if out.is_dir() or not out.suffix else out]
    if out.exists() and not out.is_dir():
        raise EnhancerError(f"-o {out} is a file; with several inputs (or a folder) -o must be a folder")
    if not out.exists() and out.suffix.lower() in audio_extensions():
        raise EnhancerError(f"-o {out} names a file; with several inputs (or a folder) -o must be a folder "
                            f"(it is created if missing)")
    dsts = [out / rel for rel in rels]
    seen: dict[Path, Path] = {}
    for (src, _), dst in zip(files, dsts):
        if dst in seen:
            raise EnhancerError(f"{seen[dst]} and {src} would both be written to {dst}; denoise them separately")
        seen[dst] = src
    return dsts


def cmd_denoise(a) -> int:
    from tqdm import tqdm

    from .audio_io import enhance_file, find_audio

    files = find_audio([Path(p) for p in a.inputs])
    if not files:
        raise EnhancerError("no audio files found in the inputs")
    dsts = output_paths(a.inputs, files, a.output, a.format)  # before loading the model: usage errors first
    enh = _enhancer(a.model, a.device)
    import soundfile as sf

    total = 0
    for src, _ in files:
        try:
            total += sf.info(str(src)).frames
        except (sf.LibsndfileError, RuntimeError):
            pass
    failed = 0
    with tqdm(total=total, unit="sample", unit_scale=True, disable=a.quiet, desc="denoise") as bar:
        for (src, _), dst in zip(files, dsts):
            try:
                enhance_file(enh, src, dst, a.atten_lim_db, progress=bar.update, format=a.format, band=a.band,
                             level=a.level)
            except EnhancerError as e:
                failed += 1
                tqdm.write(f"error: {e}", file=sys.stderr)
    n_ok = len(files) - failed
    if not a.quiet:
        where = dsts[0] if len(dsts) == 1 else Path(a.output)
        print(f"{n_ok} file(s) written to {where}" + (f", {failed} failed" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


def cmd_info(a) -> int:
    if a.model is None and not a.preset:  # --preset describes the preset, not $TIM_ENHANCER_MODEL
        a.model = a.env_model
    path = Path(a.model) if a.model else None
    exported_with = None  # the package version that wrote an .onnx model (its metadata), for people
    if path is not None and path.suffix in (".pt", ".ckpt", ".pth"):
        from .build.checkpoint import load_checkpoint
        from .build.model import count_parameters

        model = load_checkpoint(path)
        cfg, params, extra = model.config, count_parameters(model), {"versions": model.checkpoint.get("versions")}
    elif path is None and a.preset:
        from . import ModelConfig, build_model
        from .build.model import count_parameters

        cfg = ModelConfig.preset(a.preset)
        params, extra = count_parameters(build_model(cfg)), {}
    else:
        import onnxruntime as ort

        from .device_pool import uses_device_pool
        from .devices import available_providers

        enh = _enhancer(a.model, a.device)
        cfg, params, extra = enh.config, enh.engine.parameters, {
            "provider": enh.provider, "available_providers": available_providers(), "onnxruntime": ort.__version__,
            "file": str(enh.engine.path), "weights": enh.engine.weights, "rings": enh.engine.ring_format,
            # where a stream's caches live: "device" (GPU memory, `enhancer.device_pool`) or "host" (numpy)
            "stream_state": "device" if uses_device_pool(enh.engine, a.device_pool) else "host"}
        exported_with = enh.engine.metadata.get("version")
    info = {
        "preset": cfg.name, "parameters": params, "algorithmic_latency_ms": cfg.algorithmic_latency_ms,
        "stream_delay_samples_16k": cfg.delay_samples, "lookahead_frames": cfg.lookahead,
        "attention_window_frames": cfg.attention_window, **extra, "config": cfg.to_dict(),
    }
    if a.json:
        print(json.dumps(info, indent=2))
    else:
        print(info_summary(info, cfg, exported_with))
    return 0


def info_summary(info: dict, cfg, exported_with: str | None = None) -> str:
    """`enhancer info` for people: what the JSON (`--json`) says, in a few lines."""
    st = cfg.stft
    ms = 1000.0 / st.sample_rate
    rows = [("model", f"{info['preset']}, {info['parameters'] / 1e6:.2f} M parameters"
                      + (f", {info['weights']} weights" if info.get("weights") else "")
                      + (f", {info['rings']} key/value rings" if info.get("rings") else "")),
            ("file", info.get("file")),
            ("sample rate", f"{st.sample_rate} Hz (other rates are resampled)"),
            ("latency", f"{info['algorithmic_latency_ms']:g} ms algorithmic (window {st.n_fft * ms:g} ms + lookahead "
                        f"{info['lookahead_frames']} x {st.hop * ms:g} ms hops); stream delay "
                        f"{info['stream_delay_samples_16k']} samples at {st.sample_rate // 1000} kHz"),
            ("frame / hop", f"{st.n_fft} / {st.hop} samples ({st.n_fft * ms:g} / {st.hop * ms:g} ms)"),
            ("attention", f"{info['attention_window_frames']} frames ({info['attention_window_frames'] * st.hop * ms / 1000:g} s)")]
    if info.get("provider"):
        from .devices import available_providers

        rows += [("provider", f"{info['provider']} (available: {', '.join(available_providers())}; onnxruntime "
                              f"{info.get('onnxruntime', '?')}); stream state on the {info.get('stream_state', 'host')}"),
                 ("threads", f"{THREADS} onnxruntime intra-op thread(s) per session")]
    versions = info.get("versions") or {}
    if exported_with:
        versions = {"tim-enhancer": exported_with}
    written = ", ".join(f"{k} {v}" for k, v in versions.items())
    rows.append(("version", f"tim-enhancer {__version__}" + (f" (the model was written by {written})" if written else "")))
    width = max(len(k) for k, v in rows if v)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows if v) + "\n(--json for every field)"


def cmd_bench(a) -> int:
    from .bench import main as bench_main

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.int8 and not a.preset:
        print("error: --int8 applies to --preset (a model file is benchmarked as it is; export one with "
              "`enhancer export CKPT -o MODEL.onnx --int8`)", file=sys.stderr)
        return 2
    device = "cpu" if a.device == "auto" else a.device
    if a.preset and a.model:
        print("error: --preset and --model name different models: bench one or the other", file=sys.stderr)
        return 2
    models = a.model or [None if a.preset else a.env_model]  # --preset: random weights, not $TIM_ENHANCER_MODEL
    enhs = [_enhancer(m, device, a.preset, a.int8) for m in models]
    if a.profile:
        from .build.profile import format_report, report  # reads the graph with onnx ([train] extra)

        reports = [report(e.engine, (a.batches or (16,))[0], a.steps) for e in enhs]
        print(json.dumps(reports, indent=2) if a.json else "\n\n".join(format_report(r) for r in reports))
        return 0
    if not 0 < a.seconds <= 3600:
        print(f"error: --seconds must be above 0 and at most 3600, got {a.seconds:g}", file=sys.stderr)
        return 2
    return bench_main(enhs, as_json=a.json, steps=a.steps, batches=a.batches, full_steps=a.full_steps,
                      device_pool=a.device_pool, seconds=a.seconds)


def _batches(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch sizes must be whole numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return values


def version_text(model: str | None = None) -> str:
    """`enhancer --version`: the package, and the model at `model` ($TIM_ENHANCER_MODEL; None: the
    shipped one) when it loads."""
    text = f"enhancer {__version__} (tim-enhancer)"
    try:
        from .runtime import Engine, default_model_path

        engine = Engine(Path(model) if model else default_model_path(), ["CPUExecutionProvider"])
    except Exception:  # no model (or no onnxruntime) here: the package version alone
        return text
    exported = engine.metadata.get("version")
    return (f"{text}\nmodel {engine.path.name}: {engine.config.name}, {engine.weights} weights"
            + (f", exported by tim-enhancer {exported}" if exported else ""))


class _Version(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text(environment_defaults()["model"]))
        parser.exit()


def build_parser(env=None) -> argparse.ArgumentParser:
    """The `enhancer` parser; the defaults of --model, --full-steps and --device-pool come from `env`
    (default: this process's environment; `environment_defaults`)."""
    from .audio_io import OUTPUT_FORMATS

    defaults = environment_defaults(env)
    p = argparse.ArgumentParser(prog="enhancer", description="Real-time speech enhancement (TIM).",
                                epilog=ENVIRONMENT, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-V", "--version", action=_Version, help="print the version (and the model's: "
                   f"${MODEL_ENV}, else the shipped one) and exit")
    p.set_defaults(env_model=defaults["model"])  # info and bench without a model or --preset
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    devices = "auto: CUDA when this onnxruntime has it, else CPU; cuda: fail unless CUDA runs it"
    model_help = f"exported .onnx model (default: ${MODEL_ENV}, else the shipped one)"

    d = sub.add_parser("denoise", help="enhance audio files or folders",
                       description="Enhance audio files or folders. The output keeps the input's sample rate, "
                                   "channels and length; its container follows the output's extension (or --format).")
    d.add_argument("inputs", nargs="+", help="audio files or folders (any format libsndfile reads)")
    d.add_argument("-o", "--output", required=True,
                   help="output file (one input file; its extension picks the format: "
                        f"{', '.join('.' + k for k in OUTPUT_FORMATS)} or the input's own) or folder "
                        "(several inputs or a folder: created if missing)")
    d.add_argument("--format", choices=list(OUTPUT_FORMATS), default=None,
                   help="output container (as REST's format): default from the output's extension, or the "
                        "input's; into a folder, files get this extension")
    d.add_argument("--atten-lim-db", type=float, default=None, help="limit noise attenuation to this many dB")
    d.add_argument("--band", choices=["full", "speech"], default="full",
                   help="above 16 kHz: full (default) adds the band above 8 kHz back, cleaned by per-band gains "
                        "that follow its noise and the model's speech activity; speech gives the model's band only "
                        "(nothing above 8 kHz)")
    d.add_argument("--level", choices=["model", "input"], default="model", help=LEVEL_HELP)
    d.add_argument("--model", default=defaults["model"], help=model_help)
    d.add_argument("--device", choices=DEVICES, default="auto", help=f"where to run the model ({devices})")
    d.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary on stderr (errors still)")
    d.set_defaults(fn=cmd_denoise)

    from .build.command import add_export

    add_export(sub)

    from .stream_command import add_stream

    add_stream(sub)

    i = sub.add_parser("info", help="model, sample rate, latency, frame/hop, provider and version of a model")
    i.add_argument("model", nargs="?", default=None, help=f".onnx or checkpoint (default: ${MODEL_ENV}, else the "
                   "shipped model)")
    i.add_argument("--preset", default=None, help="describe a preset instead of a file (needs torch)")
    i.add_argument("--device", choices=DEVICES, default="auto",
                   help=f"load the model there and report the provider in use ({devices})")
    _device_pool_flag(i, defaults)
    i.add_argument("--json", action="store_true", help="print every field as JSON (for scripts) instead of a summary")
    i.set_defaults(fn=cmd_info)

    b = sub.add_parser("bench", help="step latency, throughput, real-time factor, memory")
    b.add_argument("--model", action="append", default=None,
                   help=f"exported .onnx model (default: ${MODEL_ENV}, else the shipped one); given more than once, "
                        "the models are measured in the same run, interleaved, and compared")
    b.add_argument("--preset", default=None, help="benchmark a preset with random weights (needs torch)")
    b.add_argument("--device", choices=DEVICES, default="auto", help="where to run the model (auto: the CPU here)")
    b.add_argument("--steps", type=int, default=300,
                   help="timed steps per batch size (the paced and search stages: a half or a quarter of it, at "
                        "least 60, or all of it below 60)")
    b.add_argument("--seconds", type=float, default=20.0, help="audio of the offline stage, in seconds")
    b.add_argument("--batches", type=_batches, default=None, metavar="B,B,...",
                   help="batch sizes (streams per step) to time (default: 1,4,16,32,64 on the CPU, "
                        "1,16,64,256,1024 under CUDA)")
    b.add_argument("--int8", action="store_true", help="with --preset: export it with 8-bit weights (export --int8)")
    b.add_argument("--json", action="store_true", help="print the results as JSON (progress stays on stderr)")
    b.add_argument("--full-steps", action=argparse.BooleanOptionalAction, default=defaults["full_steps"],
                   help="step the device pool's live steps over the whole pool through a static graph, replayed as "
                        f"a CUDA graph under CUDA (default: ${FULL_STEPS_ENV}=1)")
    _device_pool_flag(b, defaults)
    b.add_argument("--profile", action="store_true",
                   help="instead: the step graph's node count by operator, and its kernel time by operator for "
                        "live steps of the first --batches size (16) and for offline calls (needs onnx: the "
                        "[train] extra)")
    b.set_defaults(fn=cmd_bench)
    add_plugin_commands(sub, defaults)
    return p


def _device_pool_flag(parser, defaults: dict) -> None:
    parser.add_argument("--device-pool", action=argparse.BooleanOptionalAction, default=defaults["device_pool"],
                        help="keep stream state in the device pool (enhancer.device_pool) on the CPU provider too: "
                             f"a rehearsal of the GPU's code path (default: ${DEVICE_POOL_ENV}=1; under CUDA "
                             "always)")


COMMANDS_GROUP = "enhancer.commands"


def add_plugin_commands(sub, defaults: dict | None = None) -> None:
    """The sub-commands of installed packages (entry point group `enhancer.commands`), by name. One
    that cannot load is listed with the reason and fails with it when called. Their arguments named
    in `defaults` (`environment_defaults`) whose default is None take its value."""
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            add = ep.load()
        except ImportError as e:
            _unavailable(sub, ep.name, f"{type(e).__name__}: {e}")
            continue
        known = set(sub.choices)
        add(sub)
        for name in set(sub.choices) - known:
            _environment_defaults(sub.choices[name], defaults or {})


def _environment_defaults(parser: argparse.ArgumentParser, defaults: dict) -> None:
    """Give `parser`'s arguments named in `defaults` whose default is None the value there."""
    found = {a.dest for a in parser._actions if a.dest in defaults and a.default is None}
    parser.set_defaults(**{k: defaults[k] for k in found if defaults[k] is not None})


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
    except (EnhancerError, OSError) as e:  # bad input or usage, unwritable output: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # e.g. --preset / export / a checkpoint in an install without torch
        extra = " (pip install 'tim-enhancer[train]')" if (e.name or "").split(".")[0] in TRAIN_MODULES else ""
        print(f"error: this command needs the module {e.name!r}, which is not installed here{extra}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
