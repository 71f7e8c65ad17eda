"""Saving a run of ``zeroshard train``: a sharded checkpoint per ``save_every`` steps and
at the end, tried once more when it fails, the oldest past ``keep_last`` removed."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from ..checkpoint import savedir
from ..checkpoint.sharded import SaveFailed, read_manifest, resolve
from ..checkpoint.sharded import save as save_checkpoint
from .run import Run
from .settings import TrainConfig


def save_due(cfg: TrainConfig, step: int) -> bool:
    """Whether step ``step`` (counted from 1) ends with a checkpoint."""
    return bool(cfg.save_dir and ((cfg.save_every and step % cfg.save_every == 0)
                                  or step == cfg.steps))


def saved_config(cfg: TrainConfig) -> dict:
    """The settings a checkpoint keeps, the model folder as an absolute path: ``zeroshard
    export`` copies its config and tokenizer from wherever it is run."""
    d = cfg.to_dict()
    if cfg.hf_model:
        d["hf_model"] = str(Path(cfg.hf_model).expanduser().resolve())
    return d


def save(run: Run, step: int) -> None:
    """Save step ``step``'s checkpoint: the weights and optimizer state, with the step,
    the schedule, the settings, the skipped-step counters, the world and its nodes and
    (fp16) the loss scale, which resuming reads back. The save's collectives are not the
    step's traffic."""
    scaler = run.scaler
    extra = {"step": step, "scheduler": run.scheduler.state_dict(),
             "config": saved_config(run.cfg), "skipped_steps": run.skipped_steps,
             "skipped_in_a_row": run.skipped_in_a_row, "world": run.world,
             "nodes": run.nodes,
             **({"loss_scaler": scaler.state_dict()} if scaler.enabled else {})}
    _save(run, step, extra)
    run.model.comm_stats(reset=True)


def _save(run: Run, step: int, extra: dict) -> None:
    """Save, once more if it fails (a transient error: a filesystem hiccup); a second
    failure ends the run on every rank, saying which trained steps no checkpoint holds."""
    cfg = run.cfg
    path = Path(cfg.save_dir) / f"step-{step:06d}"
    try:
        save_checkpoint(run.model, run.optimizer, path, extra=extra)
        return _saved(run, step, path)
    except SaveFailed as exc:
        run.out.note(f"step {step}: {exc}; trying once more")
    try:
        save_checkpoint(run.model, run.optimizer, path, extra=extra)
        return _saved(run, step, path)
    except SaveFailed as exc:
        try:
            last = resolve(Path(cfg.save_dir))
            done = read_manifest(last)["extra"].get("step", 0)
            kept = f"the last complete checkpoint is {last} (step {done})"
        except ValueError:
            done, kept = 0, f"no complete checkpoint is in {cfg.save_dir}"
        raise SaveFailed(f"{exc}, twice. Trained through step {step}; {kept}: steps "
                         f"{done + 1}-{step} are not saved") from None


def _saved(run: Run, step: int, path: Path) -> None:
    """Say where step ``step`` went; past ``keep_last`` checkpoints, rank 0 removes the
    oldest (the others wait, so no rank reads a folder being removed)."""
    cfg, model = run.cfg, run.model
    removed = savedir.prune(cfg.save_dir, cfg.keep_last) if (
        cfg.keep_last and model.mesh.dp_rank == 0) else []
    gone = f" (removed {', '.join(p.name for p in removed)}: keep_last={cfg.keep_last})" \
        if removed else ""
    run.out.note(f"step {step}: saved checkpoint {path}{gone}")
    if cfg.keep_last:
        dist.barrier(model.mesh.dp_group)
