"""The pieces a run is made of, built once by `Trainer.setup`: its settings (mixing, batch, seed,
dropout, threads, precision, schedule), the data (the fixed validation set, the seeded example
stream, the worker processes making batches ahead), the model with its optimiser (resumed,
fine-tuned from --init, or new with feature statistics of the data) and the dev set scorer."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from enhancer import ModelConfig, build_model, load_checkpoint

from .data.audio_cache import default_cache_root
from .data.feeder import BatchFeeder
from .data.layouts import TrainingData
from .data.manifests import describe
from .data.synthesis import MixConfig, Synthesizer, validation_set
from .distributed import Dist
from .evaluation.devscore import DevScorer, load_dev_pairs
from .losses.objective import feature_stats
from .options import FitOptions
from .precision import allow_tf32, choose_precision
from .resume import ResumePoint


@dataclass
class RunData:
    cache_root: Path
    valid: dict  # the fixed validation set: noisy, clean, bandwidth_hz arrays
    synth: Synthesizer  # the seeded stream of training examples
    feeder: BatchFeeder | None  # worker processes making the batches ahead (--data-workers)


def load_data(o: FitOptions, data: TrainingData, d: Dist, mix: MixConfig, seed: int, batch_size: int,
              examples: int, log) -> RunData:
    """Decode the data once (rank 0 first, the others then read the same cache); the fixed
    validation set, the seeded example stream from example `examples` on, and its feeder."""
    cache = Path(o.cache_dir) if o.cache_dir else default_cache_root()
    if not d.main:
        d.barrier()
    sets = data.decoded(cache, o.jobs, log)
    valid = validation_set(sets["speech", "valid"], sets["noise", "valid"], sets["music", "valid"], mix,
                           o.valid_examples, o.valid_seconds, cache, log)
    if d.main:
        d.barrier()
    synth = Synthesizer(sets["speech", "train"], sets["noise", "train"], sets["music", "train"], mix, seed)
    log(f"data: {data.description}")
    for (cat, split), s in sets.items():
        if s is not None:
            log(f"  {cat:6s} {split:5s} {describe(s.items)} cached, {len(s.skipped)} skipped")
    log(f"  speech sources (share of examples): {synth.speech.shares()}")
    workers = o.data_workers
    if workers is None:
        workers = max(1, (os.cpu_count() or 1) - 2) if d.device.type == "cuda" else 0
    feeder = None
    if workers > 0:  # forked here, before the model touches CUDA
        feeder = BatchFeeder(synth, batch_size, batch_size * d.world, examples + d.rank * batch_size, workers)
        log(f"  {workers} worker process(es) make the batches ahead")
    return RunData(cache, valid, synth, feeder)


def set_dropout(model: torch.nn.Module, p: float) -> None:
    """Set the probability of every dropout layer of `model` (the config and the weights stay as they are)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = p


@dataclass
class RunModel:
    core: torch.nn.Module  # the TIMNet
    net: torch.nn.Module  # what the step runs: `core`, or its DistributedDataParallel wrapper (or compiled)
    opt: torch.optim.Optimizer
    scaler: object | None  # GradScaler for fp16


def prepare_model(o: FitOptions, d: Dist, cfg: ModelConfig, resume: ResumePoint | None, init_model,
                  synth: Synthesizer, mix: MixConfig, seed: int, dropout: float | None, precision: str,
                  log) -> RunModel:
    """The model (resumed, fine-tuned from --init, or new with feature statistics of the data),
    its DDP wrapper under torchrun, the optimiser and the fp16 gradient scaler."""
    torch.manual_seed(seed)
    if resume is not None:
        model = load_checkpoint(resume.path).train()
    elif init_model is not None:
        model = init_model.train()
        log(f"starting from the weights of {o.init}")
    else:
        model = build_model(cfg).train()
        mean, std = feature_stats(Synthesizer(synth.speech.audio, synth.noise.audio,
                                              synth.music.audio if synth.music else None, mix, seed, stream=1),
                                  o.norm_examples, cfg)
        model.set_normalization(mean, std)
    if dropout is not None:  # a training setting: inference (eval mode, the export) never drops
        set_dropout(model, dropout)
        log(f"residual dropout {dropout:g} (the model config's: {cfg.dropout:g})")
    core = model.to(d.device)
    net = core
    if d.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(core, device_ids=[d.device.index] if d.device.type == "cuda" else None, gradient_as_bucket_view=True)
    opt = torch.optim.Adam(core.parameters(), lr=o.lr)
    if o.compile:
        if d.enabled:
            raise ValueError("--compile runs in one process (not under torchrun)")
        net = torch.compile(core)
    allow_tf32(d.device)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    return RunModel(core, net, opt, scaler)


def load_teacher(o: FitOptions, cfg: ModelConfig, device, log):
    """The --teacher model (eval mode, no gradients) for the --teacher-weight term, or None. It must
    frame the audio as the student does (STFT, lookahead, log floor), so that both estimate the same
    frames; its attention window, widths and depth may differ."""
    if o.teacher_weight > 0.0 and not o.teacher:
        raise ValueError("--teacher-weight needs --teacher CKPT")
    if not o.teacher:
        return None
    if o.teacher_weight <= 0.0:
        raise ValueError("--teacher is used by the --teacher-weight term: give it a weight > 0")
    teacher = load_checkpoint(o.teacher)
    t = teacher.config
    differ = [name for name in ("stft", "lookahead", "log_eps") if getattr(t, name) != getattr(cfg, name)]
    if differ:
        raise ValueError(f"--teacher {o.teacher}: frames the audio differently from the model trained "
                         f"(differs in {', '.join(differ)})")
    for p in teacher.parameters():
        p.requires_grad_(False)
    log(f"teacher {o.teacher} ({t.name}, attention window {t.attention_window}), weight {o.teacher_weight:g}")
    return teacher.eval().to(device)


@dataclass
class RunSettings:
    mix: MixConfig
    batch_size: int  # examples per step and process
    seed: int
    dropout: float | None  # residual dropout of this run (None: the model config's)
    threads: int  # torch threads of this process
    precision: str  # autocast precision: fp32, bf16 or fp16


def choose_settings(o: FitOptions, d: Dist, resume: ResumePoint | None) -> RunSettings:
    """Mixing, batch size, seed and dropout (the resumed run's unless given), threads (set for
    torch here) and precision."""
    state = resume.state if resume else None
    base = state["mix"] if state is not None else MixConfig().to_dict()
    mix = MixConfig.from_dict({**base, **o.mix})
    batch_size = o.batch_size or (state["batch_size"] if state is not None else 16)
    if batch_size < 1:
        raise ValueError("batch size must be >= 1")
    seed = state["seed"] if state else o.seed
    dropout = o.dropout if o.dropout is not None else (state.get("dropout") if state is not None else None)
    if dropout is not None and not 0.0 <= dropout < 1.0:
        raise ValueError(f"--dropout must lie in [0, 1), got {dropout!r}")
    threads = o.threads or max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", d.world))))
    torch.set_num_threads(threads)
    return RunSettings(mix, batch_size, seed, dropout, threads, choose_precision(o.precision, d.device))


def schedule_length(o: FitOptions) -> int | None:
    """Check the schedule's options; for the cosine schedule over steps, the step at which the lr
    reaches `final_lr` (--total-steps, else --max-steps); None for plateau or --total-minutes."""
    if o.schedule not in ("plateau", "cosine"):
        raise ValueError(f"schedule must be plateau or cosine, got {o.schedule!r}")
    if o.total_minutes is not None and (o.schedule != "cosine" or o.total_steps or not o.total_minutes > 0):
        raise ValueError(f"--total-minutes {o.total_minutes:g}: needs the cosine schedule, without --total-steps, "
                         "and more than 0 minutes")
    if o.schedule != "cosine" or o.total_minutes is not None:
        return None  # plateau, or a cosine over the minutes trained (`loop.cosine_lr_by_time`)
    total = o.total_steps or o.max_steps
    if not total:
        raise ValueError("the cosine schedule needs --total-steps (or --max-steps)")
    if o.warmup_steps >= total:
        raise ValueError(f"--warmup-steps {o.warmup_steps} must be below the total {total}")
    return total


def dev_scorer(o: FitOptions, d: Dist, log) -> DevScorer | None:
    """The dev set scorer (`--dev`), if any."""
    if o.dev is None:
        return None
    pairs = load_dev_pairs(o.dev, o.dev_files)
    scorer = DevScorer(pairs, d.rank, d.world, o.dnsmos_dir)
    rule = ("PESQ-WB + DNSMOS OVRL, neither lower by more than 0.005" if scorer.dnsmos is not None
            else "PESQ-WB alone: no DNSMOS models, so residual noise is not counted")
    log(f"dev set {o.dev}: {len(pairs)} pairs scored every {o.dev_every} steps; best.pt is chosen on {rule}")
    return scorer
