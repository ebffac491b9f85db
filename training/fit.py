"""`enhancer-train fit`: the command's flags (those of the trainer's `FitOptions` come from its
declaration, `training.options`), and how they become the options and training data
(`training.loop.fit` runs it).

    enhancer-train fit --preset tim --data ../enhancer-data --out runs/tim
    torchrun --nproc_per_node=2 -m training.cli fit --preset tim --data ../enhancer-data --out runs/tim
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from enhancer import ModelConfig

from .data.manifests import DataError
from .options import FitOptions, add_options


def add_fit(sub, dnsmos_dir: Path | None = None) -> None:
    """`fit`; `dnsmos_dir`: the DNSMOS models for the dev set's tie-break (the CLI's default)."""
    p = sub.add_parser("fit", help="train a model", description="Train on DNS-style mixtures synthesised on the fly.")
    m = p.add_mutually_exclusive_group()
    m.add_argument("--preset", choices=ModelConfig.presets(), help="model preset (default: tim, or the resumed run's)")
    m.add_argument("--config", type=Path, help='model config JSON: ModelConfig fields, or {"preset": NAME, ...overrides}')
    d = p.add_argument_group("data (one of)")
    d.add_argument("--data", type=Path, help="corpus root with manifests/{speech,noise,music}_{train,valid}.tsv")
    d.add_argument("--dns-root", type=Path, help="DNS-Challenge checkout or its datasets/ folder (clean/, noise/)")
    d.add_argument("--vb-root", type=Path, help="Voicebank+DEMAND folder: clean_trainset_*_wav/ as speech, noisy minus "
                                                "clean of each pair as noise (the test set is never read)")
    d.add_argument("--speech", help="speech manifest(s): TRAIN[,VALID] (TSV or JSONL)")
    d.add_argument("--noise", help="noise manifest(s): TRAIN[,VALID]")
    d.add_argument("--music", help="music manifest(s): TRAIN[,VALID] (optional)")
    d.add_argument("--shards", help="a corpus packed by `enhancer-train pack`: its folder, or folders A,B,... "
                                    "holding its shards (decoded into memory; for machines without the corpus)")
    r = p.add_mutually_exclusive_group()
    r.add_argument("--resume", nargs="?", const="auto", default="auto", metavar="CKPT",
                   help="resume from CKPT, or by default from the latest checkpoint in --out")
    r.add_argument("--no-resume", action="store_true", help="start fresh; refuses if --out already holds checkpoints")
    add_options(p)  # the flags of FitOptions: --out, --batch-size, --lr, ... with their defaults and help
    # settings of the run's MixConfig (default: the resumed run's, else MixConfig's)
    p.add_argument("--segment-seconds", type=float, help="training segment length (default 2.0)")
    p.add_argument("--snr", type=float, nargs=2, metavar=("LO", "HI"), help="SNR range in dB (default 0 40)")
    p.add_argument("--level", type=float, nargs=2, metavar=("LO", "HI"), help="speech level range in dBFS (default -35 -15)")
    p.add_argument("--p-clean", type=float, help="share of noise-free examples (default 0.05)")
    p.add_argument("--augment", action="store_true",
                   help="switch on the augmentation recipe (reverb, EQ, speed, band-limiting, clipping, procedural "
                        "and layered noise, more music and babble; training.data.synthesis.AUGMENT_RECIPE)")
    p.add_argument("--mix", action="append", default=[], metavar="KEY=VALUE",
                   help="set one mixing/augmentation setting of training.data.synthesis.MixConfig, e.g. --mix p_reverb=0 "
                        "or --mix rt60_s=0.3,0.8 (repeatable; applied after --augment)")
    p.add_argument("--noise-weight", action="append", default=[], metavar="SOURCE=W",
                   help="draw the noise clips of SOURCE (a manifest group's first word, e.g. ambient) with weight W "
                        "instead of the default sqrt(its groups) (repeatable)")
    p.set_defaults(func=cmd_fit, dnsmos_dir=dnsmos_dir)


def model_config(args) -> ModelConfig | None:
    if args.preset:
        return ModelConfig.preset(args.preset)
    if args.config:
        if not args.config.is_file():
            raise DataError(f"--config: file not found: {args.config}")
        try:
            d = json.loads(args.config.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"--config {args.config}: not JSON ({e})") from None
        if "preset" in d:
            d = dict(d)
            return ModelConfig.preset(d.pop("preset"), **{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
        return ModelConfig.from_dict(d)
    return None


def training_data(args):
    from .data import layouts

    given = [n for n in ("data", "dns_root", "vb_root", "speech", "shards") if getattr(args, n, None)]
    if len(given) != 1:
        raise DataError("give exactly one data source: --data ROOT, --dns-root DIR, --vb-root DIR, --shards DIR, "
                        "or --speech and --noise manifests")
    if args.shards:
        from .data.shards import packed_layout

        return packed_layout([Path(f) for f in args.shards.split(",") if f], log=_log)
    if args.data:
        return layouts.corpus_layout(args.data)
    if args.dns_root:
        return layouts.dns_layout(args.dns_root)
    if getattr(args, "vb_root", None):
        noise_dir = layouts.vb_noise_dir(args.vb_root, getattr(args, "cache_dir", None))
        return layouts.vb_layout(args.vb_root, noise_dir=noise_dir, log=_log)
    if not args.noise:
        raise DataError("--speech needs --noise (and optionally --music)")
    return layouts.manifest_layout(args.speech, args.noise, args.music)


def cmd_fit(args) -> int:
    from .loop import fit

    mix = {}
    if args.segment_seconds is not None:
        mix["segment_seconds"] = args.segment_seconds
    if args.snr is not None:
        mix["snr_db"] = tuple(args.snr)
    if args.level is not None:
        mix["level_db"] = tuple(args.level)
    if args.p_clean is not None:
        mix["p_clean"] = args.p_clean
    if args.augment:
        from .data.synthesis import AUGMENT_RECIPE

        mix = {**AUGMENT_RECIPE, **mix}
    mix.update(parse_mix_settings(args.mix))
    if args.noise_weight:
        mix["noise_weights"] = parse_source_weights(args.noise_weight, "--noise-weight")
    data = training_data(args)  # checked before anything starts
    opts = FitOptions.from_args(args, config=model_config(args), mix=mix, resume=False if args.no_resume else args.resume,
                                dnsmos_dir=args.dnsmos_dir if args.dev is not None else None)
    result = fit(opts, data)
    if not args.quiet and _is_main():
        print(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in result.items()}))
    return 0


def parse_source_weights(pairs: list[str], flag: str) -> dict[str, float]:
    """["ambient=3", "0ad=0.5"] -> {"ambient": 3.0, "0ad": 0.5}; a bad pair is refused before any data is read."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        try:
            w = float(value)
        except ValueError:
            w = float("nan")
        if not sep or not key.strip() or not (w >= 0 and math.isfinite(w)):
            raise ValueError(f"{flag} {pair!r}: expected SOURCE=W with W a finite number >= 0")
        out[key.strip()] = w
    return out


def parse_mix_settings(pairs: list[str]) -> dict:
    """["p_reverb=0.3", "rt60_s=0.3,0.8"] -> {"p_reverb": 0.3, "rt60_s": (0.3, 0.8)}; unknown keys and
    bad values are refused here, before any data is read."""
    from dataclasses import fields

    from .data.synthesis import TUPLE_FIELDS, MixConfig

    known = {f.name for f in fields(MixConfig)} - {"source_weights", "noise_weights"}
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or key not in known:
            raise ValueError(f"--mix {pair!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(known))}")
        try:
            nums = tuple(float(v) for v in value.split(","))
        except ValueError:
            raise ValueError(f"--mix {pair!r}: not a number") from None
        if key in TUPLE_FIELDS:
            if len(nums) != 2:
                raise ValueError(f"--mix {pair!r}: {key} takes two numbers, LO,HI")
            out[key] = tuple(int(v) for v in nums) if key == "babble_talkers" else nums
        else:
            if len(nums) != 1:
                raise ValueError(f"--mix {pair!r}: {key} takes one number")
            out[key] = nums[0]
    MixConfig.from_dict({**MixConfig().to_dict(), **out})  # range checks
    return out


def _is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _log(msg: str) -> None:
    if _is_main():
        print(msg, file=sys.stderr, flush=True)
