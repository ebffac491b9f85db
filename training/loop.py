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

The options are `training.options.FitOptions`; `Trainer.setup` builds the run from `resume` (the
checkpoint and model config), `prepare` (settings, data, model, dev scorer) and `runfolder`.
"""
from __future__ import annotations

import gc
import math
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from enhancer import ModelConfig
from enhancer.build.model import count_parameters
from enhancer.signal import n_frames_for

from .checkpoints import CheckpointDir
from .data.feeder import BatchFeeder
from .data.layouts import TrainingData
from .data.synthesis import MixConfig, Synthesizer
from .distributed import Dist
from .evaluation.devscore import DevScore, DevScorer, combine
from .losses.objective import check_pitch_filter_loss, loss_sums
from .options import FitOptions
from .precision import autocast_for
from .prepare import (
    choose_settings,
    dev_scorer,
    load_data,
    load_teacher,
    prepare_model,
    schedule_length,
)
from .progress import Progress, StepRates
from .resume import choose_model, restore_progress, resume_point
from .runfolder import RunFolder


def full_window_seconds(cfg: ModelConfig) -> float:
    """The shortest training segment, in tenths of a second, of which at least a third of the frames
    see the whole attention window (`context_note`)."""
    window, la = cfg.attention_window, cfg.lookahead
    shortest = math.ceil((3 * window - 3 - la) / 2)  # fewest frames with 3 * full >= trained
    return math.ceil(10 * (shortest - 1) * cfg.stft.hop / cfg.stft.sample_rate) / 10


def context_note(cfg: ModelConfig, segment_samples: int) -> str | None:
    """A note when training segments are too short for the model's attention window.

    At inference every frame after the first W (`attention_window`) attends to W frames; in training
    a frame sees only the frames of its own segment before it. The loss covers the segment's
    `n_frames_for` frames less the lookahead, and output frame t attends to steps up to t + lookahead,
    so max(0, frames - W + 1) of them see a whole window: none with 2 s segments (124 of 124). None
    when at least a third of the frames see the whole window (models/MODEL_CARD.md compares segment
    lengths).
    """
    frames, window, la = n_frames_for(segment_samples, cfg.stft), cfg.attention_window, cfg.lookahead
    trained, full = frames - la, max(0, frames - window + 1)
    if 3 * full >= trained:
        return None
    return (f"note: {full} of the {trained} frames of a segment see the full {window}-frame attention window that "
            f"frames see at inference; segments of {full_window_seconds(cfg):.1f} s or more (--segment-seconds, with "
            f"a smaller --batch-size for the same audio per step) train the model on it")


def cosine_lr(step: int, peak: float, warmup: int, total: int, final: float) -> float:
    """Linear warm-up from 0 to `peak` over `warmup` steps, then a half cosine down to `final` at
    `total` (and `final` after it)."""
    return _warmup_then_cosine(step, peak, warmup, final, (step - warmup) / max(1, total - warmup))


def cosine_lr_by_time(step: int, minutes: float, peak: float, warmup: int, total_minutes: float, final: float) -> float:
    """`cosine_lr` with the decay over time: after the `warmup` steps, a half cosine from `peak` to
    `final` over the first `total_minutes` of training (`final` after it)."""
    return _warmup_then_cosine(step, peak, warmup, final, minutes / total_minutes)


def _warmup_then_cosine(step: int, peak: float, warmup: int, final: float, t: float) -> float:
    """The warm-up's lr for a step below `warmup`, else the half cosine's at `t` (clipped to [0, 1])."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, max(0.0, t))
    return final + 0.5 * (peak - final) * (1.0 + math.cos(math.pi * t))


@torch.no_grad()
def validation_loss(core, valid: dict, d: Dist, autocast, loss_floor: float | None, batch: int = 16) -> float:
    """The log-magnitude loss over the fixed validation set (each rank scores a share): the
    objective's weighted squared errors summed over every batch and process, over the weight."""
    core.eval()
    err = count = 0.0
    for start in range(d.rank * batch, len(valid["noisy"]), batch * d.world):
        sl = slice(start, start + batch)
        noisy, clean, bw = (torch.from_numpy(valid[k][sl]).to(d.device) for k in ("noisy", "clean", "bandwidth_hz"))
        sums = loss_sums(core, core, noisy, clean, bw, autocast, loss_floor)
        err += float(sums.log_err)
        count += float(sums.weight)
    core.train()
    err, count = d.sum([err, count])
    return err / max(count, 1.0)


class Trainer:
    """One run: `setup()` (resume or start, data, model, optimiser, schedule, dev set, run folder),
    then `run()` (the loop). Every attribute is created here; `setup` fills them in named steps."""

    def __init__(self, opts: FitOptions, data: TrainingData, dist: Dist | None = None, log=None):
        self.opts = opts
        self.dist = dist or Dist()
        self.log = log or (self._log if self.dist.main and not opts.quiet else (lambda *_: None))
        self.out = Path(opts.out)
        self.data = data
        self.loss = opts.loss_config()  # the objective's settings, checked once
        self.stop_reason: str | None = None
        self.ckpt = CheckpointDir(self.out, opts.keep_last)
        self.folder = RunFolder(self.out, self.dist.main)  # config.json, train.json, metrics.csv
        # the run's settings (`prepare.choose_settings`)
        self.cfg: ModelConfig | None = None
        self.mix: MixConfig | None = None
        self.batch_size = 0  # examples per step and process
        self.seed = opts.seed
        self.dropout: float | None = None  # residual dropout of this run (None: the model config's)
        self.threads = 1  # torch threads of this process
        self.precision = "fp32"  # autocast precision: fp32, bf16 or fp16
        # data (`prepare.load_data`)
        self.cache_root: Path | None = None
        self.valid: dict | None = None  # the fixed validation set: noisy, clean, bandwidth_hz arrays
        self.synth: Synthesizer | None = None  # the seeded stream of training examples
        self.feeder: BatchFeeder | None = None  # worker processes making the batches ahead (--data-workers)
        # model and optimiser (`prepare.prepare_model`)
        self.core = None  # the TIMNet
        self.net = None  # what the step runs: `core`, or its DistributedDataParallel wrapper
        self.opt: torch.optim.Optimizer | None = None
        self.scaler = None  # GradScaler for fp16
        self.teacher = None  # the --teacher model (eval mode, frozen), when the objective has a teacher term
        # progress (`resume.restore_progress`, the loop)
        self.step, self.examples, self.hours = 0, 0, 0.0
        self.lr, self.best, self.bad = opts.lr, math.inf, 0  # lr now, best validation loss, validations since
        self.best_dev: DevScore | None = None
        self.total_steps: int | None = None  # cosine schedule: the step at which the lr reaches final_lr
        self.dev_scorer: DevScorer | None = None
        self.saved_step = -1  # the step of the last checkpoint written (-1: none in this run)
        self.data_wait_s = 0.0  # this invocation's time in train_step waiting for (or making) its batches

    @staticmethod
    def _log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def _stop(self, reason: str) -> None:
        self.stop_reason = reason

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        o, d = self.opts, self.dist
        resume = resume_point(o.resume, self.ckpt, self.out)
        self.cfg, init_model = choose_model(o.config, o.init, resume)
        st = choose_settings(o, d, resume)
        self.mix, self.batch_size, self.seed, self.dropout, self.threads, self.precision = (
            st.mix, st.batch_size, st.seed, st.dropout, st.threads, st.precision)
        self.teacher = load_teacher(o, self.cfg, d.device, self.log)  # checked before the data loads
        if o.pitch_filter_loss:
            check_pitch_filter_loss(self.cfg)  # before the data loads too
        run_data = load_data(o, self.data, d, self.mix, self.seed, self.batch_size, self.examples, self.log)
        self.cache_root, self.valid, self.synth, self.feeder = (run_data.cache_root, run_data.valid, run_data.synth,
                                                                run_data.feeder)
        m = prepare_model(o, d, self.cfg, resume, init_model, self.synth, self.mix, self.seed, self.dropout,
                          self.precision, self.log)
        self.core, self.net, self.opt, self.scaler = m.core, m.net, m.opt, m.scaler
        if resume is not None:
            p = restore_progress(resume, self.opt, d, self.log)
            self.step, self.examples, self.hours, self.lr, self.best, self.bad, self.best_dev = p
        self.total_steps = schedule_length(o)
        self._apply_lr()
        self.dev_scorer = dev_scorer(o, d, self.log)
        self.saved_step = self.step if resume is not None else -1
        self.folder.start(self.step, self.cfg, o, {"mix": self.mix.to_dict(), "batch_size": self.batch_size,
                                                   "seed": self.seed, "world_size": d.world,
                                                   "data": self.data.description})
        self.log(f"model {self.cfg.name}: {count_parameters(self.core) / 1e6:.2f} M parameters; "
                 f"{d.world} process(es) x {self.threads} thread(s) on {d.device}; precision {self.precision}; "
                 f"batch {self.batch_size} x {d.world} of {self.mix.segment_seconds:g} s")
        note = context_note(self.cfg, self.mix.segment_samples)
        if note:
            self.log(note)

    def _apply_lr(self) -> None:
        """Set the optimiser's lr: the cosine schedule's at this step, else `self.lr`."""
        o = self.opts
        if o.schedule == "cosine" and o.total_minutes is not None:
            self.lr = cosine_lr_by_time(self.step, 60.0 * self.hours, o.lr, o.warmup_steps, o.total_minutes, o.final_lr)
        elif o.schedule == "cosine":
            self.lr = cosine_lr(self.step, o.lr, o.warmup_steps, self.total_steps, o.final_lr)
        for g in self.opt.param_groups:
            g["lr"] = self.lr

    def _metrics_row(self, split: str, loss: float, audio_rate: float = float("nan"), grad_norm: float = float("nan")) -> None:
        self.folder.row(self.step, self.examples, self.hours, split, loss, self.lr, audio_rate, grad_norm)

    # ------------------------------------------------------------------ one step, validation, checkpoints
    def autocast(self):
        return autocast_for(self.dist.device, self.precision)

    def train_step(self) -> tuple[float, float]:
        d = self.dist
        first = self.examples + d.rank * self.batch_size
        t0 = time.perf_counter()
        if self.feeder is not None:
            noisy, clean, bw = self.feeder.next(first)
        else:
            noisy, clean, bw = self.synth.batch(range(first, first + self.batch_size))
        self.data_wait_s += time.perf_counter() - t0
        noisy, clean, bw = (torch.from_numpy(a).to(d.device, non_blocking=True) for a in (noisy, clean, bw))
        self.opt.zero_grad(set_to_none=True)
        if self.opts.schedule == "cosine":
            self._apply_lr()
        loss = self.loss(self.net, self.core, noisy, clean, bw, self.autocast, self.teacher)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
        else:
            loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.core.parameters(), self.opts.clip_grad)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.step += 1
        self.examples += self.batch_size * d.world
        return float(loss.detach()), float(gnorm)

    def validate(self, batch: int = 16) -> float:
        return validation_loss(self.core, self.valid, self.dist, self.autocast, self.loss.loss_floor, batch)

    def score_dev(self) -> DevScore:
        return combine(self.dist.sum(self.dev_scorer.partial(self.core)))

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
        start = last_ckpt = time.time()
        progress = Progress(o.max_steps, self.step, enabled=d.main and not o.quiet)
        rates = StepRates(self.batch_size * d.world * self.mix.segment_seconds, o.log_every)
        handlers = stop_on_signals(self._stop)
        try:
            while True:
                if o.max_steps is not None and self.step >= o.max_steps:
                    self.stop_reason = self.stop_reason or f"reached --max-steps {o.max_steps}"
                    break
                t0 = time.time()
                loss, gnorm = self.train_step()
                dt = time.time() - t0
                over = o.max_minutes is not None and time.time() - start >= 60.0 * o.max_minutes
                due = time.time() - last_ckpt >= 60.0 * o.checkpoint_minutes
                loss_sum, stop, due_all, over_all, dt_sum = d.sum([loss, float(self.stop_reason is not None), float(due),
                                                                   float(over), dt])
                self.hours += dt_sum / d.world / 3600.0  # the same on every rank: --total-minutes sets the lr from it
                loss = loss_sum / d.world
                if not math.isfinite(loss):
                    raise FloatingPointError(f"step {self.step}: loss is {loss}; lower the learning rate or check the data")
                if (mean := rates.add(loss, dt)) is not None:
                    self._metrics_row("train", mean, rates.rate, gnorm)
                progress.update(self.step, loss=loss, rate=rates.shown(dt), lr=self.lr)
                if self._validate_and_save(progress, due_all):
                    last_ckpt = time.time()
                if stop and self.stop_reason is None:
                    self.stop_reason = "signal on another process"
                if over_all and self.stop_reason is None:
                    self.stop_reason = f"reached --max-minutes {o.max_minutes:g}"
                if self.stop_reason is not None:
                    break
        finally:
            progress.close()
            for s, h in handlers.items():
                signal.signal(s, h)
            if self.feeder is not None:
                self.feeder.close()
        if self.saved_step != self.step:
            self.save()
        self.log(f"stopped at step {self.step}: {self.stop_reason}; checkpoints in {self.ckpt.dir}")
        return {"step": self.step, "stop_reason": self.stop_reason, "best_valid": self.best,
                "best_dev": self.best_dev.to_dict() if self.best_dev is not None else None,
                "audio_s_per_s": rates.rate, "checkpoint": str(self.ckpt.latest()),
                # the share of the steps' time spent waiting for batches: near 0, the device (or the
                # trainer's core) bounds the run; near 1, the mixing does (more --data-workers)
                "data_wait_share": self.data_wait_s / rates.total_s if rates.total_s > 0 else None}

    def _validate_and_save(self, progress: Progress, due: bool) -> bool:
        """At this step: validate (every `valid_every`), score the dev set (every `dev_every`) and
        save, marking the best; else save when a checkpoint is `due`. True when it saved."""
        o = self.opts
        validating = bool(o.valid_every) and self.step % o.valid_every == 0
        scoring = self.dev_scorer is not None and self.step % o.dev_every == 0
        if not (validating or scoring):
            if due:
                self.save()
            return due
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
        return True



def stop_on_signals(stop) -> dict:
    """Call `stop(reason)` on SIGTERM and SIGINT (in the main thread only; the loop then stops after
    the current step); the handlers they replace, to restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, _frame):
        stop(f"received {signal.Signals(signum).name}")

    return {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}


def fit(opts: FitOptions, data: TrainingData) -> dict:
    dist = Dist()
    finished = False
    trainer = None
    try:
        trainer = Trainer(opts, data, dist)
        trainer.setup()
        result = trainer.run()
        finished = True
        return result
    finally:
        # the DistributedDataParallel wrapper holds the process group: drop it now, so that the group
        # is torn down in `close` (after the peers' barrier) and not while the interpreter exits
        trainer = None
        gc.collect()
        dist.close(finished)
