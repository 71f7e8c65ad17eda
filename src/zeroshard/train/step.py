"""One optimizer step of ``zeroshard train``, and evaluation: what the loop repeats."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from .optimizer import each
from .run import Run
from .settings import TrainConfig


def global_mean(value: torch.Tensor, world: int) -> float:
    """The mean over ranks of a scalar (a reporting collective, outside the ledger)."""
    t = value.detach().double().reshape(1)
    dist.all_reduce(t)
    return t.item() / world


def _rows(run: Run, batch: int) -> slice:
    """This rank's rows of a global batch of ``batch`` sequences: by data-parallel rank,
    so the ranks of a tensor-parallel group read the same rows."""
    rank, world = run.model.mesh.dp_rank, run.model.mesh.dp_world
    return slice(rank * batch // world, (rank + 1) * batch // world)


def evaluate(run: Run, split: str) -> float:
    """Mean loss over ``eval_batches`` fixed global batches of ``split``, each rank
    reading its rows."""
    cfg, model = run.cfg, run.model
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=run.device)
    with torch.no_grad():
        for k in range(cfg.eval_batches):
            rows = _rows(run, cfg.batch)
            x, y = run.corpus.batch(split, cfg.seed + 7919, k, cfg.batch, run.seq_len, part=rows)
            total += run.source.loss(model, x.to(run.device), y.to(run.device)).double()
    model.train(was_training)
    return global_mean(total / cfg.eval_batches, run.world)


def evaluation_due(cfg: TrainConfig, step: int) -> bool:
    """Whether step ``step`` (counted from 1) ends with an evaluation."""
    return step % cfg.eval_every == 0 or step == cfg.steps


def evaluation(run: Run, record: dict) -> None:
    """The train and validation losses into step ``record``, said and kept; the
    evaluations' collectives are not the step's traffic."""
    record["train_loss"] = evaluate(run, "train")
    record["val_loss"] = evaluate(run, "val")
    run.evals.append((record["step"], record["train_loss"], record["val_loss"]))
    run.out.eval_line(record)
    run.model.comm_stats(reset=True)


def train_step(run: Run, step: int) -> dict:
    """Optimizer step ``step`` (counted from 0): the micro-batches' forward and backward,
    unscale, clip, the optimizer's and the schedule's step, zero_grad. Returns the
    step's record (a line of the JSON log)."""
    cfg, model, optimizer, scaler = run.cfg, run.model, run.optimizer, run.scaler
    if step == cfg.steps - 1:
        _read_memory_during_the_step(run)
    if model.profiler is not None:  # steps 2-3: the gather order is recorded by then
        model.profiler.enabled = run.start + 1 <= step < run.start + 3
    t0 = time.perf_counter()
    step_loss = _micro_batches(run, step)
    opts = each(optimizer)  # one, or Muon's pair: unscaled once, stepped together
    scaler.unscale_(opts[0])
    norm = model.clip_grad_norm_(cfg.clip) if cfg.clip else None
    for o in opts:
        scaler.step(o)
    scaler.update()
    run.scheduler.step()
    for o in opts:
        o.zero_grad()
    loss_value = _loss_and_weights(run, step_loss, step)
    _count_skipped(run, step + 1)
    dt = time.perf_counter() - t0
    run.losses.append(loss_value)
    _add_traffic(run)
    record = {"step": step + 1, "loss": loss_value, "lr": run.scheduler.get_last_lr()[0],
              "grad_norm": None if norm is None else norm.item(),
              "skipped": model.last_step_skipped,
              "tokens_per_s": cfg.batch * run.seq_len / dt, "step_time_s": dt}
    if scaler.enabled:
        record["loss_scale"] = scaler.get_scale()
    return record


def _micro_batches(run: Run, step: int) -> torch.Tensor:
    """Forward and backward over this rank's rows of step ``step``'s global batch, one
    micro-batch at a time (gradients accumulate); their summed loss."""
    cfg, device, micro, accum = run.cfg, run.device, run.micro, run.accum
    base = _rows(run, cfg.batch).start
    x, y = run.corpus.batch("train", cfg.seed, step, cfg.batch, run.seq_len,
                            part=slice(base, base + micro * accum))
    step_loss = torch.zeros((), device=device)
    for m in range(accum):
        rows = slice(m * micro, (m + 1) * micro)
        loss = run.source.loss(run.model, x[rows].to(device), y[rows].to(device)) / accum
        run.scaler.scale(loss).backward()
        step_loss += loss.detach().float()
    return step_loss


def _loss_and_weights(run: Run, step_loss: torch.Tensor, step: int) -> float:
    """The step's mean loss over ranks; in the same all-reduce, the non-finite values
    the step left in the weights, which stop the run at the step that made them (a run
    whose weights end non-finite has trained nothing worth keeping)."""
    bad = sum((~torch.isfinite(p.detach())).sum() for p in run.model.parameters())
    t = torch.stack([step_loss.detach().double().reshape(()),
                     torch.as_tensor(bad, dtype=torch.float64, device=step_loss.device)])
    dist.all_reduce(t)
    loss, count = t[0].item() / run.world, int(t[1].item())
    if count:
        if step == run.start and not math.isfinite(loss):
            when = (f"before step {step + 1} (its loss is {loss}): the run started from "
                    "non-finite weights")
        else:
            when = f"in the update of step {step + 1} (its loss was {loss:.4g})"
        raise FloatingPointError(
            f"the weights became non-finite {when}; {count:,} values are nan or inf, so the "
            f"run stopped there, saving nothing of them. Lower --lr (it is {run.cfg.lr:g}), "
            "check the data, or resume the last checkpoint")
    return loss


def _read_memory_during_the_step(run: Run) -> None:
    """The memory summary is read where every category is live: after the last
    backward, once the engine has landed its reductions; the optimizer's state after
    the step (a first step creates it)."""
    model, held, opts = run.model, run.held, each(run.optimizer)
    opts[0].register_step_pre_hook(
        lambda o, a, k: held.append(model.memory(run.optimizer)) if not held else None)
    opts[-1].register_step_post_hook(
        lambda o, a, k: held[0].update(optimizer=model.memory(run.optimizer)["optimizer"]))


def _count_skipped(run: Run, step: int) -> None:
    """Say a step skipped for non-finite gradients; stop the run at ``max_skipped`` in a
    row."""
    model, cfg = run.model, run.cfg
    run.skipped_in_a_row = run.skipped_in_a_row + 1 if model.last_step_skipped else 0
    in_a_row = run.skipped_in_a_row
    if in_a_row:
        run.out.skipped(step, in_a_row, run.skipped_steps)
    if in_a_row >= cfg.max_skipped:
        raise FloatingPointError(
            f"{in_a_row} steps in a row (to step {step}) were skipped for "
            f"non-finite gradients (max_skipped={cfg.max_skipped}); the weights are "
            "those of the last good step. Lower --lr, check the data, or resume the "
            "last checkpoint")


def _add_traffic(run: Run) -> None:
    """The step's collectives, per kind, added to the run's."""
    for kind, s in run.model.comm_stats(reset=True).items():
        acc = run.comm.setdefault(kind, {"calls": 0, "bytes": 0})
        acc["calls"] += s["calls"]
        acc["bytes"] += s["bytes"]
