"""Where a run of ``zeroshard train`` starts: from a checkpoint (its weights, optimizer
state, schedule, loss scale and step), from consolidated weights (``init_from``), or
from the model's own weights at step 0.

What to resume is decided here once (``checkpoint_to_resume``), before the model is
built, and acted on here once (``resume``): a rule such as "the save folder's latest
checkpoint when there is one, else a first start" changes this module alone.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.consolidated import load_pretrained
from ..checkpoint.load import load
from ..checkpoint.sharded import resolve
from .config import TrainConfig
from .run import Run


def checkpoint_to_resume(cfg: TrainConfig) -> str | Path | None:
    """The checkpoint this run resumes: ``cfg.resume``'s path, or for "latest" the save
    folder (whose ``latest`` names it); None for a first start. Set-up asks before it
    builds the model: weights a checkpoint replaces are not read, and a resumed run's
    JSON log is appended to."""
    if not cfg.resume:
        return None
    return Path(cfg.save_dir) if cfg.resume == "latest" else cfg.resume


def resume(run: Run) -> int:
    """Resume if there is something to resume: ``run.checkpoint``'s weights, optimizer
    state, schedule and loss scale, or ``init_from``'s weights. Returns the step to start
    from (0: a first start)."""
    cfg, out = run.cfg, run.out
    if cfg.init_from:
        load_pretrained(run.model, cfg.init_from)
        out.note(f"loaded weights from {cfg.init_from}")
    if run.checkpoint is None:
        return 0
    extra = load(run.model, run.optimizer, run.checkpoint)  # every rank agrees before any raises
    ckpt = resolve(run.checkpoint)
    if not {"step", "scheduler"} <= set(extra):
        raise ValueError(f"{cfg.resume}: a checkpoint without the trainer's step and "
                         "schedule (saved by zs.save without extra={'step': ..., "
                         "'scheduler': ...}?); start from its weights with --init-from "
                         "after `zeroshard export`, or resume a checkpoint of zeroshard train")
    start = extra["step"]
    if start >= cfg.steps:  # found before launch under zeroshard train; not under torchrun
        raise ValueError(f"resume={cfg.resume!r}: {ckpt} is at step {start} and steps="
                         f"{cfg.steps}: nothing to train; give --steps above {start}")
    run.scheduler.load_state_dict(extra["scheduler"])
    if run.scaler.enabled and "loss_scaler" in extra:  # fp16: the scale and its counters
        run.scaler.load_state_dict(extra["loss_scaler"])
    out.note(f"resumed from {ckpt} (step {start}): weights, optimizer state, schedule")
    return start
