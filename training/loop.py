"""The training loop: `fit(options)`.

Per step, each rank synthesises its share of the batch (examples `E + rank*B ... E + rank*B + B-1`
of the seeded stream, E = examples seen so far), computes noisy and clean log-magnitudes, runs the
model without end padding and takes the MSE on the log-magnitude (bins above a source's bandwidth
masked), clips the gradient norm and steps Adam. Every `valid_every` steps the fixed validation set
is scored; the learning rate halves after `patience` validations without improvement, and the best
model is kept. Checkpoints are written every `checkpoint_minutes`, at each validation, at the end
and on SIGTERM/SIGINT; a run resumes from its latest checkpoint by default, bit-exactly (same
examples, same dropout masks).

Under `torchrun` the model is wrapped in DistributedDataParallel (gloo on CPU, nccl on CUDA); rank 0
writes checkpoints, metrics and progress.
"""
from __future__ import annotations

import csv
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from enhancer import ModelConfig, build_model, load_checkpoint
from enhancer.checkpoint import read_checkpoint
from enhancer.errors import CheckpointError
from enhancer.model import count_parameters
from enhancer.signal import n_frames_for

from .data.audio_cache import default_cache_root
from .checkpoints import CheckpointDir
from .data.synthesis import MixConfig, Synthesizer, validation_set
from .evaluation.devscore import DevScore, DevScorer, combine, load_dev_pairs
from .distributed import Dist
from .data.feeder import BatchFeeder
from .data.layouts import TrainingData
from .data.manifests import describe
from .losses.objective import batch_loss, feature_stats, loss_sums
from .progress import Progress

METRICS_COLUMNS = ("step", "examples", "hours", "split", "loss", "lr", "audio_s_per_s", "grad_norm")


@dataclass
class FitOptions:
    out: Path
    config: ModelConfig | None = None  # None: from the checkpoint when resuming, else the `tim` preset
    batch_size: int | None = None  # per process; None: the run's own when resuming, else 16
    mix: dict = field(default_factory=dict)  # MixConfig fields to override (segment_seconds, snr_db, ...)
    max_steps: int | None = None
    max_minutes: float | None = None
    resume: bool | str = True  # True: the latest checkpoint in OUT if any; a path; False: refuse if OUT has one
    init: str | None = None  # fine-tune: a fresh run starting from this checkpoint's weights (e.g. models/tim.pt)
    lr: float = 2e-4
    lr_factor: float = 0.5
    patience: int = 5  # validations without improvement before the learning rate halves
    min_lr: float = 1e-6
    clip_grad: float = 5.0
    valid_every: int = 1000  # steps
    valid_examples: int = 256
    valid_seconds: float = 4.0
    checkpoint_minutes: float = 5.0
    keep_last: int = 3
    log_every: int = 10  # steps per metrics row
    seed: int = 0
    precision: str = "auto"  # auto | fp32 | bf16 | fp16 (fp16: CUDA only)
    threads: int | None = None
    norm_examples: int = 256
    cache_dir: Path | None = None
    jobs: int | None = None  # processes decoding audio into the cache
    quiet: bool = False
    loss_floor: float | None = None  # None: the model's log_eps (see training.losses.objective)
    compressed_weight: float = 0.0  # weight of the compressed-magnitude term (training.losses.objective.batch_loss)
    sisdr_weight: float = 0.0  # weight of the -SI-SDR (dB) of the resynthesised waveform
    mrstft_weight: float = 0.0  # weight of the multi-resolution STFT loss of the resynthesised waveform
    pesq_weight: float = 0.0  # weight of the P.862 disturbance of the estimated magnitudes (training.losses.perceptual)
    pesq_compensate: bool = False  # that term with P.862's level/frequency/gain compensations (ablation only)
    overestimate_weight: float = 1.0  # magnitude errors where the estimate exceeds the clean, relative (1: symmetric)
    schedule: str = "plateau"  # plateau: halve after `patience` bad validations; cosine: warm-up, then cosine decay
    warmup_steps: int = 0
    total_steps: int | None = None  # cosine: the step at which the lr reaches final_lr (default: max_steps)
    final_lr: float = 1e-6
    dev: Path | None = None  # paired noisy/ clean/ folders scored by PESQ-WB; best.pt is then chosen on it
    dev_every: int = 500
    dev_files: int | None = 48  # an evenly spaced selection of the dev pairs (None: all)
    dnsmos_dir: Path | None = None  # DNSMOS models for the tie-break (None: PESQ alone)
    compile: bool = False  # torch.compile the model (one process)
    data_workers: int | None = None  # processes making batches ahead (training.data.feeder); None: 0 on CPU, cores - 2 on CUDA
    dropout: float | None = None  # residual dropout of this run; None: the resumed run's, else the model config's


def set_dropout(model: torch.nn.Module, p: float) -> None:
    """Set the probability of every dropout layer of `model` (the config and the weights stay as they are)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = p


def choose_precision(requested: str, device: torch.device) -> str:
    if requested == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "fp32"
    if requested not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be auto, fp32, bf16 or fp16, got {requested!r}")
    if requested == "fp16" and device.type != "cuda":
        raise ValueError("fp16 autocast needs CUDA; use bf16 or fp32 on CPU")
    return requested


def autocast_for(device: torch.device, precision: str):
    """The autocast context of a precision chosen by `choose_precision` (fp32: none)."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def allow_tf32(device: torch.device) -> None:
    """On CUDA, let the fp32 matrix products that autocast leaves use the tensor cores (tf32)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def context_note(cfg: ModelConfig, segment_samples: int) -> str | None:
    """A note when training segments are too short for the model's attention window.

    At inference every frame after the first W (`attention_window`) attends to W frames; in training
    a frame sees only the frames of its own segment before it. The loss covers the segment's
    `n_frames_for` frames less the lookahead, and output frame t attends to steps up to t + lookahead,
    so max(0, frames - W + 1) of them see a whole window: none with 2 s segments (124 of 124), while
    the model card's phase 13 measured 4 s segments (batch 8) at +0.030 PESQ-WB and 8 s (batch 4) at
    +0.015 over 2 s (batch 16), the same audio per step, on the unseen-source dev set. None when at
    least a third of the frames see the whole window.
    """
    frames, window, la = n_frames_for(segment_samples, cfg.stft), cfg.attention_window, cfg.lookahead
    trained, full = frames - la, max(0, frames - window + 1)
    if 3 * full >= trained:
        return None
    shortest = math.ceil((3 * window - 3 - la) / 2)  # fewest frames with 3 * full >= trained
    seconds = math.ceil(10 * (shortest - 1) * cfg.stft.hop / cfg.stft.sample_rate) / 10
    return (f"note: {full} of the {trained} frames of a segment see the full {window}-frame attention window that "
            f"frames see at inference; segments of {seconds:.1f} s or more (--segment-seconds, with a smaller "
            f"--batch-size for the same audio per step) train the model on it")


def cosine_lr(step: int, peak: float, warmup: int, total: int, final: float) -> float:
    """Linear warm-up from 0 to `peak` over `warmup` steps, then a half cosine down to `final` at
    `total` (and `final` after it)."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, total - warmup)
    t = min(1.0, max(0.0, (step - warmup) / span))
    return final + 0.5 * (peak - final) * (1.0 + math.cos(math.pi * t))


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from: its path, what `read_checkpoint` read, its training state."""

    path: Path
    blob: dict
    state: dict  # blob["extra"]["train"]: step, examples, hours, lr, best_valid, mix, seed, batch_size ...


# --------------------------------------------------------------------------- the trainer
class Trainer:
    """One run: `setup()` (resume or start, data, model, optimiser, schedule, dev set, run folder),
    then `run()` (the loop). Every attribute is created here; `setup` fills them in named steps."""

    def __init__(self, opts: FitOptions, data: TrainingData, dist: Dist | None = None, log=None):
        self.opts = opts
        self.dist = dist or Dist()
        self.log = log or (self._log if self.dist.main and not opts.quiet else (lambda *_: None))
        self.out = Path(opts.out)
        self.data = data
        self.stop_reason: str | None = None
        self.ckpt = CheckpointDir(self.out, opts.keep_last)
        # the run's settings (`_choose_model`, `_choose_settings`)
        self.cfg: ModelConfig | None = None
        self.mix: MixConfig | None = None
        self.batch_size = 0  # examples per step and process
        self.seed = opts.seed
        self.threads = 1  # torch threads of this process
        self.precision = "fp32"  # autocast precision: fp32, bf16 or fp16
        # data (`_load_data`)
        self.cache_root: Path | None = None
        self.valid: dict | None = None  # the fixed validation set: noisy, clean, bandwidth_hz arrays
        self.synth: Synthesizer | None = None  # the seeded stream of training examples
        self.feeder: BatchFeeder | None = None  # worker processes making the batches ahead (--data-workers)
        # model and optimiser (`_build_model`)
        self.core = None  # the TIMNet
        self.net = None  # what the step runs: `core`, or its DistributedDataParallel wrapper
        self.opt: torch.optim.Optimizer | None = None
        self.scaler = None  # GradScaler for fp16
        # progress (`_restore_progress`, the loop)
        self.step, self.examples, self.hours = 0, 0, 0.0
        self.lr, self.best, self.bad = opts.lr, math.inf, 0  # lr now, best validation loss, validations since
        self.best_dev: DevScore | None = None
        self.total_steps: int | None = None  # cosine schedule: the step at which the lr reaches final_lr
        self.dev_scorer: DevScorer | None = None
        self.saved_step = -1  # the step of the last checkpoint written (-1: none in this run)

    @staticmethod
    def _log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        resume = self._resume_point()
        init_model = self._choose_model(resume)
        self._choose_settings(resume)
        self._load_data()
        self._build_model(resume, init_model)
        self._restore_progress(resume)
        self._setup_schedule()
        self._setup_dev()
        self._start_run_folder(resume)
        d = self.dist
        self.log(f"model {self.cfg.name}: {count_parameters(self.core) / 1e6:.2f} M parameters; "
                 f"{d.world} process(es) x {self.threads} thread(s) on {d.device}; precision {self.precision}; "
                 f"batch {self.batch_size} x {d.world} of {self.mix.segment_seconds:g} s")
        note = context_note(self.cfg, self.mix.segment_samples)
        if note:
            self.log(note)

    def _resume_point(self) -> ResumePoint | None:
        """The checkpoint to resume from (`--resume`, by default the latest in OUT), if any."""
        path = self._resume_path(self.ckpt)
        if path is None:
            return None
        blob = read_checkpoint(path)
        state = blob["extra"].get("train")
        if state is None:
            raise CheckpointError(f"{path} holds no training state (not written by enhancer-train fit)")
        return ResumePoint(path, blob, state)

    def _choose_model(self, resume: ResumePoint | None):
        """The model config: the resumed run's, --init's (fine-tuning: returns that model), or the
        options' (default `tim`)."""
        o = self.opts
        self.cfg = self._model_config(resume.blob if resume else None, resume.path if resume else None)
        if resume is not None or not o.init:
            return None
        init_model = load_checkpoint(o.init)  # fine-tuning: weights, config and feature statistics of the checkpoint
        if o.config is not None and o.config != init_model.config:
            raise CheckpointError(f"--init {o.init}: its config ({init_model.config.name}) differs from --preset/--config")
        self.cfg = init_model.config
        return init_model

    def _choose_settings(self, resume: ResumePoint | None) -> None:
        """Mixing, batch size and seed (the resumed run's unless given), threads and precision."""
        o, d = self.opts, self.dist
        state = resume.state if resume else None
        base = state["mix"] if state is not None else MixConfig().to_dict()
        self.mix = MixConfig.from_dict({**base, **o.mix})
        self.batch_size = o.batch_size or (state["batch_size"] if state is not None else 16)
        if self.batch_size < 1:
            raise ValueError("batch size must be >= 1")
        if not o.overestimate_weight > 0.0:
            raise ValueError(f"--overestimate-weight must be > 0, got {o.overestimate_weight!r}")
        if not o.pesq_weight >= 0.0:
            raise ValueError(f"--pesq-weight must be >= 0, got {o.pesq_weight!r}")
        self.seed = state["seed"] if state else o.seed
        self.dropout = o.dropout if o.dropout is not None else (state.get("dropout") if state is not None else None)
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must lie in [0, 1), got {self.dropout!r}")
        self.threads = o.threads or max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", d.world))))
        torch.set_num_threads(self.threads)
        self.precision = choose_precision(o.precision, d.device)

    def _load_data(self) -> None:
        """Decode the data once (rank 0 first, the others then read the same cache); the fixed
        validation set and the seeded example stream."""
        o, d = self.opts, self.dist
        cache = Path(o.cache_dir) if o.cache_dir else default_cache_root()
        self.cache_root = cache
        if not d.main:
            d.barrier()
        sets = self.data.decoded(cache, o.jobs, self.log)
        self.valid = validation_set(sets["speech", "valid"], sets["noise", "valid"], sets["music", "valid"], self.mix,
                                    o.valid_examples, o.valid_seconds, cache, self.log)
        if d.main:
            d.barrier()
        self.synth = Synthesizer(sets["speech", "train"], sets["noise", "train"], sets["music", "train"], self.mix, self.seed)
        self.log(f"data: {self.data.description}")
        for (cat, split), s in sets.items():
            if s is not None:
                self.log(f"  {cat:6s} {split:5s} {describe(s.items)} cached, {len(s.skipped)} skipped")
        self.log(f"  speech sources (share of examples): {self.synth.speech.shares()}")
        workers = o.data_workers
        if workers is None:
            workers = max(1, (os.cpu_count() or 1) - 2) if d.device.type == "cuda" else 0
        if workers > 0:  # forked here, before the model touches CUDA
            self.feeder = BatchFeeder(self.synth, self.batch_size, self.batch_size * d.world,
                                      self.examples + d.rank * self.batch_size, workers)
            self.log(f"  {workers} worker process(es) make the batches ahead")

    def _build_model(self, resume: ResumePoint | None, init_model) -> None:
        """The model (resumed, fine-tuned from --init, or new with feature statistics of the data),
        its DDP wrapper under torchrun, the optimiser and the fp16 gradient scaler."""
        o, d = self.opts, self.dist
        torch.manual_seed(self.seed)
        if resume is not None:
            model = load_checkpoint(resume.path).train()
        elif init_model is not None:
            model = init_model.train()
            self.log(f"starting from the weights of {o.init}")
        else:
            model = build_model(self.cfg).train()
            mean, std = feature_stats(Synthesizer(self.synth.speech.audio, self.synth.noise.audio,
                                                  self.synth.music.audio if self.synth.music else None, self.mix,
                                                  self.seed, stream=1), o.norm_examples, self.cfg)
            model.set_normalization(mean, std)
        if self.dropout is not None:  # a training setting: inference (eval mode, the export) never drops
            set_dropout(model, self.dropout)
            self.log(f"residual dropout {self.dropout:g} (the model config's: {self.cfg.dropout:g})")
        self.core = model.to(d.device)
        self.net = self.core
        if d.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.net = DDP(self.core, device_ids=[d.device.index] if d.device.type == "cuda" else None,
                           gradient_as_bucket_view=True)
        self.opt = torch.optim.Adam(self.core.parameters(), lr=o.lr)
        if o.compile:
            if d.enabled:
                raise ValueError("--compile runs in one process (not under torchrun)")
            self.net = torch.compile(self.core)
        allow_tf32(d.device)
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None

    def _restore_progress(self, resume: ResumePoint | None) -> None:
        """Step, audio seen, learning rate, best scores, optimiser state and random state of the
        resumed run (a new run starts at step 0)."""
        o, d = self.opts, self.dist
        self.step, self.examples, self.hours = 0, 0, 0.0
        self.lr, self.best, self.bad = o.lr, math.inf, 0
        self.best_dev = None
        if resume is None:
            return
        state, extra = resume.state, resume.blob["extra"]
        self.opt.load_state_dict(extra["optimizer"])
        self.step, self.examples, self.hours = state["step"], state["examples"], state["hours"]
        self.lr, self.best, self.bad = state["lr"], state["best_valid"], state["bad_validations"]
        rng = extra.get("rng") or []
        if len(rng) == d.world:
            torch.set_rng_state(rng[d.rank])
        else:
            self.log(f"warning: checkpoint has random states for {len(rng)} process(es), this run has {d.world}; "
                     "dropout masks will differ from an uninterrupted run")
        self.log(f"resumed from {resume.path} at step {self.step} ({self.examples} examples, lr {self.lr:.2e}, "
                 f"best valid {self.best:.4f})")
        self.best_dev = DevScore.from_dict(state.get("best_dev"))

    def _start_run_folder(self, resume: ResumePoint | None) -> None:
        """config.json, train.json and metrics.csv (rows past the resumed step dropped), on rank 0."""
        self.saved_step = self.step if resume is not None else -1
        if self.dist.main:
            self.out.mkdir(parents=True, exist_ok=True)
            self._write_run_files()
            self._trim_metrics()

    def _setup_schedule(self) -> None:
        """Check the schedule's options and set the optimiser's lr for the current step."""
        o = self.opts
        if o.schedule not in ("plateau", "cosine"):
            raise ValueError(f"schedule must be plateau or cosine, got {o.schedule!r}")
        if o.schedule == "cosine":
            self.total_steps = o.total_steps or o.max_steps
            if not self.total_steps:
                raise ValueError("the cosine schedule needs --total-steps (or --max-steps)")
            if o.warmup_steps >= self.total_steps:
                raise ValueError(f"--warmup-steps {o.warmup_steps} must be below the total {self.total_steps}")
        self._apply_lr()

    def _apply_lr(self) -> None:
        """Set the optimiser's lr: the cosine schedule's at this step, else `self.lr`."""
        o = self.opts
        if o.schedule == "cosine":
            self.lr = cosine_lr(self.step, o.lr, o.warmup_steps, self.total_steps, o.final_lr)
        for g in self.opt.param_groups:
            g["lr"] = self.lr

    def _setup_dev(self) -> None:
        """The dev set scorer (`--dev`), if any."""
        o, d = self.opts, self.dist
        self.dev_scorer = None
        if o.dev is None:
            return
        pairs = load_dev_pairs(o.dev, o.dev_files)
        self.dev_scorer = DevScorer(pairs, d.rank, d.world, o.dnsmos_dir)
        self.log(f"dev set {o.dev}: {len(pairs)} pairs scored every {o.dev_every} steps (PESQ-WB"
                 f"{', DNSMOS OVRL tie-break' if self.dev_scorer.dnsmos is not None else ''}); best.pt is chosen on it")

    def score_dev(self) -> DevScore:
        return combine(self.dist.sum(self.dev_scorer.partial(self.core)))

    def _resume_path(self, ckdir: CheckpointDir) -> Path | None:
        r = self.opts.resume
        if isinstance(r, (str, Path)) and r not in ("auto",):
            p = Path(r)
            if not p.is_file():
                raise CheckpointError(f"--resume: checkpoint not found: {p}")
            return p
        latest = ckdir.latest()
        if r is False and latest is not None:
            raise CheckpointError(f"{self.out} already holds checkpoints ({latest.name}); resume (the default) "
                                  "or choose another --out")
        return latest if r is not False else None

    def _model_config(self, blob, path) -> ModelConfig:
        given = self.opts.config
        if blob is None:
            return given or ModelConfig.preset("tim")
        stored = ModelConfig.from_dict(blob["config"])
        if given is not None and given != stored:
            diff = [k for k, v in given.to_dict().items() if stored.to_dict().get(k) != v]
            raise CheckpointError(f"{path}: the run was started with a different model (differs in {', '.join(diff)}); "
                                  "use the same --preset/--config or another --out")
        return stored

    def _write_run_files(self) -> None:
        (self.out / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=2) + "\n")
        opts = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self.opts).items() if k not in ("config", "mix")}
        info = {"options": opts, "mix": self.mix.to_dict(), "batch_size": self.batch_size, "seed": self.seed, "world_size": self.dist.world,
                "data": self.data.description}
        (self.out / "train.json").write_text(json.dumps(info, indent=2, default=str) + "\n")

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.csv"

    def _trim_metrics(self) -> None:
        """Drop metric rows past the resumed step (written after the last checkpoint of a crashed run)."""
        p = self.metrics_path
        if not p.exists():
            with open(p, "w", newline="") as f:
                csv.writer(f).writerow(METRICS_COLUMNS)
            return
        with open(p, newline="") as f:
            rows = list(csv.DictReader(f))
        keep = [r for r in rows if int(r["step"]) <= self.step]
        if len(keep) != len(rows):
            with open(p, "w", newline="") as f:
                w = csv.DictWriter(f, METRICS_COLUMNS)
                w.writeheader()
                w.writerows(keep)

    def _metrics_row(self, split: str, loss: float, audio_rate: float = float("nan"), grad_norm: float = float("nan")) -> None:
        if not self.dist.main:
            return
        with open(self.metrics_path, "a", newline="") as f:
            csv.writer(f).writerow([self.step, self.examples, f"{self.hours:.5f}", split, f"{loss:.6f}", f"{self.lr:.3e}",
                                    f"{audio_rate:.2f}", f"{grad_norm:.4f}"])

    # ------------------------------------------------------------------ one step
    def autocast(self):
        return autocast_for(self.dist.device, self.precision)

    def train_step(self) -> tuple[float, float]:
        o, d = self.opts, self.dist
        first = self.examples + d.rank * self.batch_size
        if self.feeder is not None:
            noisy, clean, bw = self.feeder.next(first)
        else:
            noisy, clean, bw = self.synth.batch(range(first, first + self.batch_size))
        dev = d.device
        noisy, clean, bw = (torch.from_numpy(a).to(dev, non_blocking=True) for a in (noisy, clean, bw))
        self.opt.zero_grad(set_to_none=True)
        if o.schedule == "cosine":
            self._apply_lr()
        loss = batch_loss(self.net, self.core, noisy, clean, bw, self.autocast, o.loss_floor, o.compressed_weight,
                          sisdr_weight=o.sisdr_weight, mrstft_weight=o.mrstft_weight,
                          overestimate_weight=o.overestimate_weight, pesq_weight=o.pesq_weight,
                          pesq_compensate=o.pesq_compensate)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
        else:
            loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.core.parameters(), o.clip_grad)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.step += 1
        self.examples += self.batch_size * d.world
        return float(loss.detach()), float(gnorm)

    @torch.no_grad()
    def validate(self, batch: int = 16) -> float:
        """The log-magnitude loss over the fixed validation set (each rank scores a share): the
        objective's weighted squared errors summed over every batch and process, over the weight."""
        self.core.eval()
        v, d = self.valid, self.dist
        err = count = 0.0
        for start in range(d.rank * batch, len(v["noisy"]), batch * d.world):
            sl = slice(start, start + batch)
            noisy, clean, bw = (torch.from_numpy(v[k][sl]).to(d.device) for k in ("noisy", "clean", "bandwidth_hz"))
            sums = loss_sums(self.core, self.core, noisy, clean, bw, self.autocast, self.opts.loss_floor)
            err += float(sums.log_err)
            count += float(sums.weight)
        self.core.train()
        err, count = d.sum([err, count])
        return err / max(count, 1.0)

    # ------------------------------------------------------------------ checkpoints
    def save(self, best: bool = False) -> None:
        rng = self.dist.gather(torch.get_rng_state())
        self.saved_step = self.step
        if not self.dist.main:
            return
        extra = {
            "train": {"step": self.step, "examples": self.examples, "hours": self.hours, "lr": self.lr,
                      "best_valid": self.best, "bad_validations": self.bad, "seed": self.seed,
                      "mix": self.mix.to_dict(), "world_size": self.dist.world,
                      "batch_size": self.batch_size, "dropout": self.dropout,
                      "best_dev": self.best_dev.to_dict() if self.best_dev is not None else None},
            "optimizer": self.opt.state_dict(),
            "rng": rng,
        }
        self.ckpt.save(self.core, self.cfg, self.step, **extra)
        if best:
            self.ckpt.save_best(self.core, self.cfg, **extra)

    def after_validation(self, loss: float) -> bool:
        """Update the plateau schedule; True if this is the best model so far."""
        o = self.opts
        if loss < self.best - 1e-5:
            self.best, self.bad = loss, 0
            return True
        self.bad += 1
        if o.schedule == "plateau" and self.bad >= o.patience and self.lr > o.min_lr:
            self.lr = max(self.lr * o.lr_factor, o.min_lr)
            self.bad = 0
            self._apply_lr()
            self.log(f"validation loss has not improved for {o.patience} validations: lr -> {self.lr:.2e}")
        return False

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        o, d = self.opts, self.dist
        seconds_per_step = self.batch_size * d.world * self.mix.segment_seconds
        start = time.time()
        last_ckpt = time.time()
        progress = Progress(o.max_steps, self.step, enabled=d.main and not o.quiet)
        acc_loss = acc_n = 0
        acc_time = 0.0
        rate = float("nan")
        handlers = self._install_signals()
        try:
            while True:
                if o.max_steps is not None and self.step >= o.max_steps:
                    self.stop_reason = self.stop_reason or f"reached --max-steps {o.max_steps}"
                    break
                t0 = time.time()
                loss, gnorm = self.train_step()
                dt = time.time() - t0
                self.hours += dt / 3600.0
                over = o.max_minutes is not None and time.time() - start >= 60.0 * o.max_minutes
                due = time.time() - last_ckpt >= 60.0 * o.checkpoint_minutes
                loss_sum, stop, due_all, over_all = d.sum([loss, float(self.stop_reason is not None), float(due), float(over)])
                loss = loss_sum / d.world
                if not math.isfinite(loss):
                    raise FloatingPointError(f"step {self.step}: loss is {loss}; lower the learning rate or check the data")
                acc_loss, acc_n, acc_time = acc_loss + loss, acc_n + 1, acc_time + dt
                if acc_n >= o.log_every:
                    rate = seconds_per_step * acc_n / acc_time
                    self._metrics_row("train", acc_loss / acc_n, rate, gnorm)
                    acc_loss = acc_n = 0
                    acc_time = 0.0
                progress.update(self.step, loss=loss, rate=rate if math.isfinite(rate) else seconds_per_step / dt, lr=self.lr)
                validating = bool(o.valid_every) and self.step % o.valid_every == 0
                scoring = self.dev_scorer is not None and self.step % o.dev_every == 0
                if validating or scoring:
                    best = False
                    if validating:
                        vloss = self.validate()
                        best_loss = self.after_validation(vloss)
                        best = best_loss and self.dev_scorer is None
                        self._metrics_row("valid", vloss)
                        progress.write(f"step {self.step}: valid loss {vloss:.4f}{' (best)' if best_loss else ''}, "
                                       f"lr {self.lr:.2e}")
                    if scoring:
                        score = self.score_dev()
                        best = score.better_than(self.best_dev)
                        if best:
                            self.best_dev = score
                        self._metrics_row("dev_pesq_wb", score.pesq_wb)
                        if math.isfinite(score.dnsmos_ovrl):
                            self._metrics_row("dev_dnsmos_ovrl", score.dnsmos_ovrl)
                        progress.write(f"step {self.step}: dev PESQ-WB {score.pesq_wb:.3f}, DNSMOS OVRL "
                                       f"{score.dnsmos_ovrl:.3f} on {score.files} files{' (best)' if best else ''}")
                    self.save(best=best)
                    last_ckpt = time.time()
                elif due_all:
                    self.save()
                    last_ckpt = time.time()
                if stop and self.stop_reason is None:
                    self.stop_reason = "signal on another process"
                if over_all and self.stop_reason is None:
                    self.stop_reason = f"reached --max-minutes {o.max_minutes:g}"
                if self.stop_reason is not None:
                    break
        finally:
            progress.close()
            self._restore_signals(handlers)
            if self.feeder is not None:
                self.feeder.close()
        if self.saved_step != self.step:
            self.save()
        self.log(f"stopped at step {self.step}: {self.stop_reason}; checkpoints in {self.ckpt.dir}")
        return {"step": self.step, "stop_reason": self.stop_reason, "best_valid": self.best,
                "best_dev": self.best_dev.to_dict() if self.best_dev is not None else None,
                "audio_s_per_s": rate, "checkpoint": str(self.ckpt.latest())}

    def _install_signals(self):
        if not _in_main_thread():
            return {}

        def handler(signum, _frame):
            self.stop_reason = f"received {signal.Signals(signum).name}"

        return {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}

    @staticmethod
    def _restore_signals(handlers) -> None:
        for s, h in handlers.items():
            signal.signal(s, h)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def fit(opts: FitOptions, data: TrainingData) -> dict:
    dist = Dist()
    finished = False
    try:
        trainer = Trainer(opts, data, dist)
        trainer.setup()
        result = trainer.run()
        finished = True
        return result
    finally:
        dist.close(finished)
