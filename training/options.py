"""The options of a training run (`FitOptions`), declared once: each field carries its default and,
when `enhancer-train fit` sets it, its flag's help and arguments (`flag`: the flag is `--field-name`);
`add_options` builds the command's flags from them and `FitOptions.from_args` reads them back.

The field order is that of `train.json`'s "options" (the trainer writes the fields in order).
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from enhancer import ModelConfig


def flag(help: str | None = None, **kwargs) -> dict:
    """The metadata of a `FitOptions` field that `fit` sets with a flag `--field-name`: its `help` and
    `add_argument`'s other arguments (type, choices, metavar, action...); the flag's default is the
    field's."""
    return {"flag": {"help": help, **kwargs}}


@dataclass
class FitOptions:
    out: Path = field(metadata=flag("run folder: checkpoints/, metrics.csv, config.json", type=Path, required=True))
    config: ModelConfig | None = None  # None: from the checkpoint when resuming, else the `tim` preset
    batch_size: int | None = field(default=None, metadata=flag(  # per process
        "examples per step and process (default 16)", type=int))
    mix: dict = field(default_factory=dict)  # MixConfig fields to override (segment_seconds, snr_db, ...)
    max_steps: int | None = field(default=None, metadata=flag("stop after this many steps in total", type=int))
    max_minutes: float | None = field(default=None, metadata=flag(
        "stop after this many minutes of this invocation", type=float))
    # True: the latest checkpoint in OUT if any; a path; False: refuse if OUT has one (`--resume`, `--no-resume`)
    resume: bool | str = True
    init: str | None = field(default=None, metadata=flag(
        "fine-tune: start a new run from the weights of CKPT (e.g. models/tim.pt)", metavar="CKPT"))
    lr: float = field(default=2e-4, metadata=flag(type=float))
    lr_factor: float = 0.5
    patience: int = field(default=5, metadata=flag("validations without improvement before the lr halves", type=int))
    min_lr: float = 1e-6
    clip_grad: float = field(default=5.0, metadata=flag("max gradient norm", type=float))
    valid_every: int = field(default=1000, metadata=flag("steps between validations (0: never)", type=int))
    valid_examples: int = field(default=256, metadata=flag(type=int))
    valid_seconds: float = field(default=4.0, metadata=flag(type=float))
    checkpoint_minutes: float = field(default=5.0, metadata=flag(type=float))
    keep_last: int = field(default=3, metadata=flag(type=int))
    log_every: int = field(default=10, metadata=flag("steps per row of metrics.csv", type=int))
    seed: int = field(default=0, metadata=flag(type=int))
    precision: str = field(default="auto", metadata=flag(  # fp16: CUDA only
        "autocast precision (auto: fp32 on CPU, bf16/fp16 on CUDA)", choices=("auto", "fp32", "bf16", "fp16")))
    threads: int | None = field(default=None, metadata=flag(
        "torch threads per process (default: cores / processes)", type=int))
    norm_examples: int = field(default=256, metadata=flag("examples for the feature statistics", type=int))
    cache_dir: Path | None = field(default=None, metadata=flag(
        "16 kHz audio cache (default ~/.cache/tim-enhancer/audio)", type=Path))
    jobs: int | None = field(default=None, metadata=flag(
        "processes decoding audio into the cache (default: all cores)", type=int))
    quiet: bool = field(default=False, metadata=flag(action="store_true"))
    loss_floor: float | None = field(default=None, metadata=flag(  # None: the model's log_eps
        "the loss compares log(|S| + floor) (default: the model's log_eps, 1e-4; e.g. 1e-2 so that inaudibly "
        "quiet bins do not dominate); inputs are unchanged", type=float))
    compressed_weight: float = field(default=0.0, metadata=flag(
        "add this weight times the MSE of |magnitude|^0.3 (estimate against clean) to the log-magnitude loss "
        "(default 0: the log-magnitude loss alone)", type=float))
    sisdr_weight: float = field(default=0.0, metadata=flag(
        "add this weight times the mean -SI-SDR (dB) of the waveform resynthesised from the gains and the noisy "
        "phase (default 0: off; training.losses.objective)", type=float))
    mrstft_weight: float = field(default=0.0, metadata=flag(
        "add this weight times the multi-resolution STFT loss of the resynthesised waveform (default 0: off)",
        type=float))
    pesq_weight: float = field(default=0.0, metadata=flag(
        "add this weight times a differentiable model of wideband PESQ's disturbance (ITU-T P.862.2; 4.5 minus "
        "the raw score) of the estimated magnitudes (default 0: off; training.losses.perceptual)", type=float))
    pesq_compensate: bool = field(default=False, metadata=flag(
        "compute the --pesq-weight term with P.862's own level, frequency-response and gain compensations, as "
        "the standard scores: it forgives colouring and attenuating speech, which a model then learns (ablation "
        "only; training/README.md)", action="store_true"))
    overestimate_weight: float = field(default=1.0, metadata=flag(
        "weight of the magnitude terms' errors in bins where the estimate exceeds the clean magnitude (noise "
        "left in) relative to bins where it falls short (speech removed); default 1: symmetric; e.g. 2 to "
        "suppress more, as PESQ penalises added energy more", type=float))
    residual_weight: float = field(default=0.0, metadata=flag(
        "add this weight times the MSE of |magnitude|^0.3 over the noise left in noise-dominated bins (|noise| > "
        "|speech| and the estimate above the clean magnitude), per bin compared (default 0: off)", type=float))
    teacher: str | None = field(default=None, metadata=flag(
        "a trained model (.pt) with the same framing whose estimate on the same input the --teacher-weight term "
        "compares with (e.g. the shipped model, teaching one with a shorter attention window)", metavar="CKPT"))
    teacher_weight: float = field(default=0.0, metadata=flag(
        "add this weight times the MSE between the log-magnitude estimate and --teacher's, per bin compared "
        "(default 0: off)", type=float))
    pitch_filter_loss: bool = field(default=False, metadata=flag(
        "compute every term on the gains applied after the model's pitch filter, as inference applies them "
        "(needs a model with one, e.g. --init models/tim.pt; the filter itself gets no gradient)",
        action="store_true"))
    schedule: str = field(default="plateau", metadata=flag(
        "plateau: halve the lr after --patience validations without improvement; cosine: linear warm-up "
        "over --warmup-steps, then cosine decay to --final-lr at --total-steps (or --total-minutes)", choices=("plateau", "cosine")))
    warmup_steps: int = field(default=0, metadata=flag(type=int))
    total_steps: int | None = field(default=None, metadata=flag(
        "cosine: the planned length of the run in steps (default --max-steps)", type=int))
    total_minutes: float | None = field(default=None, metadata=flag(
        "cosine: the planned length of the run in minutes of training steps (resumes included) instead of "
        "--total-steps: the decay follows the time trained, so it ends at --final-lr however fast the "
        "machine steps (a GPU stage with a fixed budget)", type=float))
    final_lr: float = field(default=1e-6, metadata=flag(type=float))
    dev: Path | None = field(default=None, metadata=flag(
        "dev set folder (noisy/, clean/; e.g. from `devset --unseen`) scored by PESQ-WB every --dev-every "
        "steps; best.pt is then the best on it (DNSMOS OVRL breaks ties)", type=Path))
    dev_every: int = field(default=500, metadata=flag(type=int))
    # an evenly spaced selection of the dev pairs (None: all; the flag's 0)
    dev_files: int | None = field(default=48, metadata=flag("evenly spaced dev pairs scored (0: all)", type=int))
    dnsmos_dir: Path | None = None  # DNSMOS models for the tie-break (None: PESQ alone)
    compile: bool = field(default=False, metadata=flag(
        "torch.compile the model (one process; faster on CUDA)", action="store_true"))
    data_workers: int | None = field(default=None, metadata=flag(
        "processes making the batches ahead (default: 0 on CPU, cores - 2 on CUDA)", type=int))
    dropout: float | None = field(default=None, metadata=flag(
        "residual dropout of this run (default: the resumed run's, else the model config's: 0.1 for the "
        "presets); e.g. 0 to fine-tune without it. Inference never drops, so the exported model and its config "
        "do not depend on it", type=float, metavar="P"))

    def loss_config(self):
        """The objective's settings, a `training.losses.objective.LossConfig` (which checks them)."""
        from .losses.objective import LossConfig  # torch: only where a run starts

        return LossConfig(**{f.name: getattr(self, f.name) for f in fields(LossConfig) if hasattr(self, f.name)})

    @classmethod
    def from_args(cls, args: argparse.Namespace, **settings) -> FitOptions:
        """The options of `fit`'s parsed flags (`add_options`), with `settings` for the fields that no
        flag sets; `--dev-files 0` means all the dev pairs (None)."""
        given = {f.name: getattr(args, f.name) for f in flagged_fields(cls)}
        given["dev_files"] = given["dev_files"] or None
        return cls(**given, **settings)


def flagged_fields(cls=FitOptions):
    return [f for f in fields(cls) if "flag" in f.metadata]


def add_options(parser: argparse.ArgumentParser, cls=FitOptions) -> None:
    """Add a flag `--field-name` for every field of `cls` with `flag` metadata, in field order."""
    for f in flagged_fields(cls):
        kwargs = {k: v for k, v in f.metadata["flag"].items() if v is not None}
        if f.default is not MISSING:
            kwargs.setdefault("default", f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)
