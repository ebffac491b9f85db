"""`enhancer-train fit`: the command's flags, and how they become the trainer's `FitOptions`
and training data (`training.loop.fit` runs it).

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


def add_fit(sub, dnsmos_dir: Path | None = None) -> None:
    """`fit`; `dnsmos_dir`: the DNSMOS models for the dev set's tie-break (the CLI's default)."""
    p = sub.add_parser("fit", help="train a model", description="Train on DNS-style mixtures synthesised on the fly.")
    m = p.add_mutually_exclusive_group()
    m.add_argument("--preset", choices=ModelConfig.presets(), help="model preset (default: tim, or the resumed run's)")
    m.add_argument("--config", type=Path, help='model config JSON: ModelConfig fields, or {"preset": NAME, ...overrides}')
    d = p.add_argument_group("data (one of)")
    d.add_argument("--data", type=Path, help="corpus root with manifests/{speech,noise,music}_{train,valid}.tsv")
    d.add_argument("--dns-root", type=Path, help="DNS-Challenge checkout or its datasets/ folder (clean/, noise/)")
    d.add_argument("--speech", help="speech manifest(s): TRAIN[,VALID] (TSV or JSONL)")
    d.add_argument("--noise", help="noise manifest(s): TRAIN[,VALID]")
    d.add_argument("--music", help="music manifest(s): TRAIN[,VALID] (optional)")
    d.add_argument("--shards", help="a corpus packed by `enhancer-train pack`: its folder, or folders A,B,... "
                                    "holding its shards (decoded into memory; for machines without the corpus)")
    p.add_argument("--out", type=Path, required=True, help="run folder: checkpoints/, metrics.csv, config.json")
    p.add_argument("--batch-size", type=int, help="examples per step and process (default 16)")
    p.add_argument("--segment-seconds", type=float, help="training segment length (default 2.0)")
    p.add_argument("--max-steps", type=int, help="stop after this many steps in total")
    p.add_argument("--max-minutes", type=float, help="stop after this many minutes of this invocation")
    r = p.add_mutually_exclusive_group()
    r.add_argument("--resume", nargs="?", const="auto", default="auto", metavar="CKPT",
                   help="resume from CKPT, or by default from the latest checkpoint in --out")
    r.add_argument("--no-resume", action="store_true", help="start fresh; refuses if --out already holds checkpoints")
    p.add_argument("--init", metavar="CKPT", help="fine-tune: start a new run from the weights of CKPT (e.g. models/tim.pt)")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--patience", type=int, default=5, help="validations without improvement before the lr halves")
    p.add_argument("--clip-grad", type=float, default=5.0, help="max gradient norm")
    p.add_argument("--valid-every", type=int, default=1000, help="steps between validations (0: never)")
    p.add_argument("--valid-examples", type=int, default=256)
    p.add_argument("--valid-seconds", type=float, default=4.0)
    p.add_argument("--checkpoint-minutes", type=float, default=5.0)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--log-every", type=int, default=10, help="steps per row of metrics.csv")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--snr", type=float, nargs=2, metavar=("LO", "HI"), help="SNR range in dB (default 0 40)")
    p.add_argument("--level", type=float, nargs=2, metavar=("LO", "HI"), help="speech level range in dBFS (default -35 -15)")
    p.add_argument("--p-clean", type=float, help="share of noise-free examples (default 0.05)")
    p.add_argument("--loss-floor", type=float, help="the loss compares log(|S| + floor) (default: the model's log_eps, "
                   "1e-4; e.g. 1e-2 so that inaudibly quiet bins do not dominate); inputs are unchanged")
    p.add_argument("--compressed-weight", type=float, default=0.0,
                   help="add this weight times the MSE of |magnitude|^0.3 (estimate against clean) to the "
                        "log-magnitude loss (default 0: the log-magnitude loss alone)")
    p.add_argument("--sisdr-weight", type=float, default=0.0,
                   help="add this weight times the mean -SI-SDR (dB) of the waveform resynthesised from the gains "
                        "and the noisy phase (default 0: off; training.losses.objective)")
    p.add_argument("--mrstft-weight", type=float, default=0.0,
                   help="add this weight times the multi-resolution STFT loss of the resynthesised waveform "
                        "(default 0: off)")
    p.add_argument("--pesq-weight", type=float, default=0.0,
                   help="add this weight times a differentiable model of wideband PESQ's disturbance "
                        "(ITU-T P.862.2; 4.5 minus the raw score) of the estimated magnitudes "
                        "(default 0: off; training.losses.perceptual)")
    p.add_argument("--pesq-compensate", action="store_true",
                   help="compute the --pesq-weight term with P.862's own level, frequency-response and gain "
                        "compensations, as the standard scores: it forgives colouring and attenuating speech, "
                        "which a model then learns (ablation only; training/README.md)")
    p.add_argument("--overestimate-weight", type=float, default=1.0,
                   help="weight of the magnitude terms' errors in bins where the estimate exceeds the clean "
                        "magnitude (noise left in) relative to bins where it falls short (speech removed); "
                        "default 1: symmetric; e.g. 2 to suppress more, as PESQ penalises added energy more")
    p.add_argument("--dropout", type=float, metavar="P",
                   help="residual dropout of this run (default: the resumed run's, else the model config's: 0.1 "
                        "for the presets); e.g. 0 to fine-tune without it. Inference never drops, so the "
                        "exported model and its config do not depend on it")
    p.add_argument("--augment", action="store_true",
                   help="switch on the augmentation recipe (reverb, EQ, speed, band-limiting, clipping, procedural "
                        "and layered noise, more music and babble; training.data.synthesis.AUGMENT_RECIPE)")
    p.add_argument("--mix", action="append", default=[], metavar="KEY=VALUE",
                   help="set one mixing/augmentation setting of training.data.synthesis.MixConfig, e.g. --mix p_reverb=0 "
                        "or --mix rt60_s=0.3,0.8 (repeatable; applied after --augment)")
    p.add_argument("--schedule", choices=("plateau", "cosine"), default="plateau",
                   help="plateau: halve the lr after --patience validations without improvement; cosine: linear "
                        "warm-up over --warmup-steps, then cosine decay to --final-lr at --total-steps")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--total-steps", type=int, help="cosine: the planned length of the run in steps (default --max-steps)")
    p.add_argument("--final-lr", type=float, default=1e-6)
    p.add_argument("--dev", type=Path, help="dev set folder (noisy/, clean/; e.g. from `devset --unseen`) scored by "
                   "PESQ-WB every --dev-every steps; best.pt is then the best on it (DNSMOS OVRL breaks ties)")
    p.add_argument("--dev-every", type=int, default=500)
    p.add_argument("--dev-files", type=int, default=48, help="evenly spaced dev pairs scored (0: all)")
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                   help="autocast precision (auto: fp32 on CPU, bf16/fp16 on CUDA)")
    p.add_argument("--data-workers", type=int, help="processes making the batches ahead (default: 0 on CPU, "
                                                    "cores - 2 on CUDA)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (one process; faster on CUDA)")
    p.add_argument("--threads", type=int, help="torch threads per process (default: cores / processes)")
    p.add_argument("--norm-examples", type=int, default=256, help="examples for the feature statistics")
    p.add_argument("--cache-dir", type=Path, help="16 kHz audio cache (default ~/.cache/tim-enhancer/audio)")
    p.add_argument("--jobs", type=int, help="processes decoding audio into the cache (default: all cores)")
    p.add_argument("--quiet", action="store_true")
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

    given = [n for n in ("data", "dns_root", "speech", "shards") if getattr(args, n)]
    if len(given) != 1:
        raise DataError("give exactly one data source: --data ROOT, --dns-root DIR, --shards DIR, "
                        "or --speech and --noise manifests")
    if args.shards:
        from .data.shards import packed_layout

        return packed_layout([Path(f) for f in args.shards.split(",") if f], log=_log)
    if args.data:
        return layouts.corpus_layout(args.data)
    if args.dns_root:
        return layouts.dns_layout(args.dns_root)
    if not args.noise:
        raise DataError("--speech needs --noise (and optionally --music)")
    return layouts.manifest_layout(args.speech, args.noise, args.music)


def cmd_fit(args) -> int:
    from .loop import FitOptions, fit

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
    data = training_data(args)  # checked before anything starts
    opts = FitOptions(
        out=args.out, config=model_config(args), batch_size=args.batch_size, mix=mix, max_steps=args.max_steps,
        max_minutes=args.max_minutes, resume=False if args.no_resume else args.resume, init=args.init, lr=args.lr,
        patience=args.patience, clip_grad=args.clip_grad, valid_every=args.valid_every,
        valid_examples=args.valid_examples, valid_seconds=args.valid_seconds,
        checkpoint_minutes=args.checkpoint_minutes, keep_last=args.keep_last, log_every=args.log_every,
        seed=args.seed, precision=args.precision, threads=args.threads, norm_examples=args.norm_examples,
        cache_dir=args.cache_dir, jobs=args.jobs, quiet=args.quiet, loss_floor=args.loss_floor,
        compressed_weight=args.compressed_weight, sisdr_weight=args.sisdr_weight, mrstft_weight=args.mrstft_weight,
        overestimate_weight=args.overestimate_weight, pesq_weight=args.pesq_weight,
        pesq_compensate=args.pesq_compensate, schedule=args.schedule, warmup_steps=args.warmup_steps,
        total_steps=args.total_steps, final_lr=args.final_lr,
        dev=args.dev, dev_every=args.dev_every, dev_files=args.dev_files or None,
        dnsmos_dir=args.dnsmos_dir if args.dev is not None else None, data_workers=args.data_workers,
        compile=args.compile, dropout=args.dropout,
    )
    result = fit(opts, data)
    if not args.quiet and _is_main():
        print(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in result.items()}))
    return 0


def parse_mix_settings(pairs: list[str]) -> dict:
    """["p_reverb=0.3", "rt60_s=0.3,0.8"] -> {"p_reverb": 0.3, "rt60_s": (0.3, 0.8)}; unknown keys and
    bad values are refused here, before any data is read."""
    from dataclasses import fields

    from .data.synthesis import TUPLE_FIELDS, MixConfig

    known = {f.name for f in fields(MixConfig)} - {"source_weights"}
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
