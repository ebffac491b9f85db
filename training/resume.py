"""Where a run starts: the checkpoint it resumes from (`--resume`, by default the latest in OUT), the
model config it trains (the resumed run's, `--init`'s, or the options'), and the progress and
optimiser state it resumes with."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from enhancer import ModelConfig, load_checkpoint
from enhancer.build.checkpoint import read_checkpoint
from enhancer.errors import CheckpointError

from .checkpoints import CheckpointDir
from .evaluation.devscore import DevScore


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from: its path, what `read_checkpoint` read, its training state."""

    path: Path
    blob: dict
    state: dict  # blob["extra"]["train"]: step, examples, hours, lr, best_valid, mix, seed, batch_size ...


def resume_point(resume: bool | str | Path, ckdir: CheckpointDir, out: Path) -> ResumePoint | None:
    """The checkpoint to resume from, if any: `resume` is a path, True or "auto" (the latest in
    `ckdir`), or False (none, and `ckdir` must hold none)."""
    path = _resume_path(resume, ckdir, out)
    if path is None:
        return None
    blob = read_checkpoint(path)
    state = blob["extra"].get("train")
    if state is None:
        raise CheckpointError(f"{path} holds no training state (not written by enhancer-train fit)")
    return ResumePoint(path, blob, state)


def _resume_path(resume: bool | str | Path, ckdir: CheckpointDir, out: Path) -> Path | None:
    if isinstance(resume, (str, Path)) and resume not in ("auto",):
        p = Path(resume)
        if not p.is_file():
            raise CheckpointError(f"--resume: checkpoint not found: {p}")
        return p
    latest = ckdir.latest()
    if resume is False and latest is not None:
        raise CheckpointError(f"{out} already holds checkpoints ({latest.name}); resume (the default) "
                              "or choose another --out")
    return latest if resume is not False else None


def choose_model(given: ModelConfig | None, init: str | None, resume: ResumePoint | None):
    """(model config, the --init model or None): the resumed run's config, --init's (fine-tuning:
    its weights, config and feature statistics), or `given` (default `tim`)."""
    cfg = _model_config(given, resume)
    if resume is not None or not init:
        return cfg, None
    init_model = load_checkpoint(init)
    if given is not None and given != init_model.config:
        raise CheckpointError(f"--init {init}: its config ({init_model.config.name}) differs from --preset/--config")
    return init_model.config, init_model


def _model_config(given: ModelConfig | None, resume: ResumePoint | None) -> ModelConfig:
    if resume is None:
        return given or ModelConfig.preset("tim")
    stored = ModelConfig.from_dict(resume.blob["config"])
    if given is not None and given != stored:
        diff = [k for k, v in given.to_dict().items() if stored.to_dict().get(k) != v]
        raise CheckpointError(f"{resume.path}: the run was started with a different model (differs in "
                              f"{', '.join(diff)}); use the same --preset/--config or another --out")
    return stored


def restore_progress(resume: ResumePoint, opt, dist, log) -> tuple:
    """Load the resumed run's optimiser state into `opt` and this process's random state; its
    (step, examples, hours, lr, best validation loss, validations since, best dev score)."""
    state, extra = resume.state, resume.blob["extra"]
    opt.load_state_dict(extra["optimizer"])
    rng = extra.get("rng") or []
    if len(rng) == dist.world:
        torch.set_rng_state(rng[dist.rank])
    else:
        log(f"warning: checkpoint has random states for {len(rng)} process(es), this run has {dist.world}; "
            "dropout masks will differ from an uninterrupted run")
    log(f"resumed from {resume.path} at step {state['step']} ({state['examples']} examples, lr {state['lr']:.2e}, "
        f"best valid {state['best_valid']:.4f})")
    return (state["step"], state["examples"], state["hours"], state["lr"], state["best_valid"],
            state["bad_validations"], DevScore.from_dict(state.get("best_dev")))
