"""`enhancer export`: a checkpoint's streaming step graph to ONNX (float, float16 or 8-bit
weights, int8 key/value rings calibrated on audio), checked against torch. The `enhancer` command
line adds it (`add_export`); its function imports torch and onnx when it runs, not before.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from ..errors import AudioError


def add_export(sub) -> None:
    """Add `export` to the `enhancer` command's sub-parsers (`sub`)."""
    e = sub.add_parser("export", help="export a checkpoint's streaming step graph to ONNX")
    e.add_argument("checkpoint", help="torch checkpoint (.pt) to export")
    e.add_argument("-o", "--output", required=True, help="the .onnx file to write")
    e.add_argument("--no-check", action="store_true", help="skip onnx.checker and the onnxruntime/torch comparison")
    e.add_argument("--fp16", action="store_true", help="store weights as float16 (half the size; computed in float32)")
    e.add_argument("--int8", action="store_true",
                   help="dense layers in 8 bits (the large ones as onnxruntime MatMulIntegerToFloat on inputs quantized row "
                        "by row, the small ones as MatMulNBits blocks): faster steps, not bit-exact (checked: output "
                        ">= 30 dB above its difference from torch)")
    e.add_argument("--int8-rings", action="store_true",
                   help="key/value rings as int8 (a quarter of the memory per stream; the live step's ring products "
                        "in 8-bit arithmetic), scaled per layer and head on --calibrate; not bit-exact (checked "
                        "like --int8)")
    e.add_argument("--calibrate", nargs="+", default=None, metavar="AUDIO",
                   help="with --int8-rings: audio files or folders to calibrate the ring scales on (noisy speech)")
    e.add_argument("--ring-scales-from", default=None, metavar="ONNX",
                   help="with --int8-rings: the ring scales of an earlier export of this model instead of --calibrate "
                        "(the same 8-bit rings, e.g. after an update of the exporter)")
    e.add_argument("--gain-exponent", type=float, default=None, metavar="E",
                   help="raise the network's gains to this power in the exported graph (0.5..4; > 1 removes more of "
                        "the noise left under speech); default: the checkpoint's")
    e.add_argument("--rise-limit", type=float, default=None, metavar="G",
                   help="in noisy streams, keep network gains below G from rising above the previous frame's "
                        "(removes bursts of residual noise; 0 = off); default: the checkpoint's")
    e.add_argument("--pitch-filter", type=float, default=None, metavar="S",
                   help="in voiced frames, mix the noisy spectrum with the input one pitch period earlier, with "
                        "strength S, before the gains apply (removes noise between the voice's harmonics; 0 = off); "
                        "default: the checkpoint's")
    e.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr (the JSON report still goes to stdout)")
    e.add_argument("--save-checkpoint", default=None, metavar="PT",
                   help="also write the exported weights as a torch checkpoint without training state")
    e.set_defaults(fn=cmd_export)


def cmd_export(a) -> int:
    from .checkpoint import load_checkpoint, save_checkpoint
    from .export import MAX_REL_DIFF, export_step, round_to_fp16
    from .quantize import MIN_PARITY_SNR_DB

    if not a.quiet:
        print(f"loading {a.checkpoint}", file=sys.stderr, flush=True)
    model = load_checkpoint(a.checkpoint)
    post = {k: v for k, v in (("gain_exponent", a.gain_exponent), ("rise_limit_gain", a.rise_limit),
                              ("pitch_filter", a.pitch_filter)) if v is not None}
    if post:
        try:
            model.config = dataclasses.replace(model.config, **post)
            model.config.validate()
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if a.fp16:
        round_to_fp16(model)
    signals = None
    if a.ring_scales_from and (not a.int8_rings or a.calibrate):
        print("error: --ring-scales-from applies to --int8-rings, instead of --calibrate", file=sys.stderr)
        return 2
    if a.int8_rings and a.ring_scales_from:
        signals = Path(a.ring_scales_from)
    elif a.int8_rings:
        if not a.calibrate:
            print("error: --int8-rings needs --calibrate AUDIO (files or folders of speech in noise, as the model "
                  "will hear it; a few minutes are plenty)", file=sys.stderr)
            return 2
        try:
            signals = _calibration_signals(a.calibrate)
        except (OSError, ValueError) as e:
            print(f"error: --calibrate: {e}", file=sys.stderr)
            return 2
    elif a.calibrate:
        print("error: --calibrate applies to --int8-rings", file=sys.stderr)
        return 2
    try:
        report = export_step(model, a.output, check=not a.no_check, verbose=not a.quiet, fp16_weights=a.fp16,
                             int8_weights=a.int8, ring_calibration=signals)
    except ValueError as e:
        if signals is None:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.save_checkpoint:  # weights only (no training state), e.g. the shipped models/tim.pt
        report["checkpoint"] = str(save_checkpoint(model, model.config, a.save_checkpoint, half=a.fp16))
    print(json.dumps(report, indent=2))
    eight_bit = a.int8 or a.int8_rings  # not bit-exact: gated on the output's distance from torch
    if eight_bit and "parity_snr_db" in report and report["parity_snr_db"] < MIN_PARITY_SNR_DB:
        print(f"error: the 8-bit graph's output is only {report['parity_snr_db']:.1f} dB above its difference from "
              f"torch (needs {MIN_PARITY_SNR_DB:g} dB)", file=sys.stderr)
        return 1
    if not eight_bit and "max_rel_diff" in report and not report["max_rel_diff"] <= MAX_REL_DIFF:
        print(f"error: onnxruntime differs from torch by {report['max_abs_diff']:.3g}, "
              f"{report['max_rel_diff']:.3g} of the output's peak (allowed: {MAX_REL_DIFF:g})", file=sys.stderr)
        return 1
    return 0


def _calibration_signals(paths: list[str]):
    """The audio under `paths` (files or folders) as 16 kHz mono float32 arrays, read lazily."""
    from ..audio_io import find_audio
    from ..config import SAMPLE_RATE
    from ..signal import check_audio, resample

    files = [f for f, _ in find_audio([Path(p) for p in paths])]
    if not files:
        raise ValueError(f"no audio files in {' '.join(paths)}")

    def signals():
        import soundfile as sf

        for f in files:
            try:
                x, sr = sf.read(str(f), dtype="float32", always_2d=True)
                x = check_audio(x.mean(axis=1), str(f))
            except (RuntimeError, AudioError) as e:  # soundfile's errors are RuntimeErrors
                raise ValueError(f"{f}: cannot read it as audio ({e})") from None
            yield x if sr == SAMPLE_RATE else resample(x, sr, SAMPLE_RATE)

    return signals()
