"""The training loop that runs on every rank of ``zeroshard train``."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .._paths import folder
from ..checkpoint import load, load_pretrained, save, savedir
from ..checkpoint.sharded import SaveFailed, read_manifest, resolve
from ..runtime.dist import default_device, init_distributed
from ..runtime.step.scaler import GradScaler
from .board import Board
from .config import TrainConfig
from .datasource import open_source
from .hfmodel import model_source
from .profile import profile_report
from .report import Reporter, layout


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    warmup = cfg.warmup if cfg.warmup is not None else max(1, cfg.steps // 10)

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, cfg.steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def _saved_config(cfg: TrainConfig) -> dict:
    """The settings a checkpoint keeps, the model folder as an absolute path: ``zeroshard
    export`` copies its config and tokenizer from wherever it is run."""
    d = cfg.to_dict()
    if cfg.hf_model:
        d["hf_model"] = str(Path(cfg.hf_model).expanduser().resolve())
    return d


def _global_mean(value: torch.Tensor, world: int) -> float:
    """The mean over ranks of a scalar (a reporting collective, outside the ledger)."""
    t = value.detach().double().reshape(1)
    dist.all_reduce(t)
    return t.item() / world


def evaluate(model, source, corpus, cfg: TrainConfig, split: str, rank: int, world: int,
             seq_len: int) -> float:
    """Mean loss over ``eval_batches`` fixed global batches of ``split``, each rank
    reading its rows."""
    was_training = model.training
    model.eval()
    device = default_device()
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for k in range(cfg.eval_batches):
            rows = slice(rank * cfg.batch // world, (rank + 1) * cfg.batch // world)
            x, y = corpus.batch(split, cfg.seed + 7919, k, cfg.batch, seq_len, part=rows)
            total += source.loss(model, x.to(device), y.to(device)).double()
    model.train(was_training)
    return _global_mean(total / cfg.eval_batches, world)


def _save(model, optimizer, cfg: TrainConfig, step: int, extra: dict, out) -> None:
    """Save step ``step``'s checkpoint, once more if it fails (a transient error: a
    filesystem hiccup); a second failure ends the run on every rank, saying which
    trained steps no checkpoint holds."""
    path = Path(cfg.save_dir) / f"step-{step:06d}"
    try:
        save(model, optimizer, path, extra=extra)
        return _saved(model, cfg, step, path, out)
    except SaveFailed as exc:
        out.note(f"step {step}: {exc}; trying once more")
    try:
        save(model, optimizer, path, extra=extra)
        return _saved(model, cfg, step, path, out)
    except SaveFailed as exc:
        try:
            last = resolve(Path(cfg.save_dir))
            done = read_manifest(last)["extra"].get("step", 0)
            kept = f"the last complete checkpoint is {last} (step {done})"
        except ValueError:
            done, kept = 0, f"no complete checkpoint is in {cfg.save_dir}"
        raise SaveFailed(f"{exc}, twice. Trained through step {step}; {kept}: steps "
                         f"{done + 1}-{step} are not saved") from None


def _saved(model, cfg: TrainConfig, step: int, path: Path, out) -> None:
    """Say where step ``step`` went; past ``keep_last`` checkpoints, rank 0 removes the
    oldest (the others wait, so no rank reads a folder being removed)."""
    removed = savedir.prune(cfg.save_dir, cfg.keep_last) if (
        cfg.keep_last and model.comm.dp_rank == 0) else []
    gone = f" (removed {', '.join(p.name for p in removed)}: keep_last={cfg.keep_last})" \
        if removed else ""
    out.note(f"step {step}: saved checkpoint {path}{gone}")
    if cfg.keep_last:
        dist.barrier(model.comm.group)


def train(cfg: TrainConfig) -> dict:
    """Run the whole job on this rank; rank 0 prints. Returns the losses (for tests)."""
    rank, world = init_distributed(timeout_s=cfg.timeout)
    device = default_device()  # batches are made on the host, the same on every rank
    micro, accum = cfg.accumulation(world)
    for name in ("save_dir", "profile"):  # under torchrun no launcher checked them
        if getattr(cfg, name):
            folder(name, getattr(cfg, name))
    source = model_source(cfg)
    seq_len = source.seq_len
    model = source.build(load_weights=not (cfg.resume or cfg.init_from))
    if model.profiler is not None:
        model.profiler.enabled = False
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    # fp16: dynamic loss scaling, every rank alike (skipped steps count as skips below)
    fp16 = model.zero_config.recipe.param_dtype == "fp16"
    scaler = (GradScaler.from_deepspeed(model, {"fp16": cfg.loss_scaler})
              if fp16 and cfg.loss_scaler is not None else GradScaler(model, enabled=fp16))
    corpus = open_source(cfg, source.vocab, seq_len, rank)
    unit_params = [sum(p.numel() for p in u.params) for u in model.units]
    out = Reporter(cfg, world, micro, accum, sum(unit_params), enabled=rank == 0,
                   label=source.label, origin=source.source)
    log = (open(cfg.json_log, "a" if cfg.resume else "w", encoding="utf-8")
           if cfg.json_log and rank == 0 else None)
    losses, evals = [], []
    start = 0
    out.header()
    if cfg.init_from:
        load_pretrained(model, cfg.init_from)
        out.note(f"loaded weights from {cfg.init_from}")
    if cfg.resume:
        where = Path(cfg.save_dir) if cfg.resume == "latest" else cfg.resume
        extra = load(model, optimizer, where)  # every rank agrees before any raises
        ckpt = resolve(where)
        if not {"step", "scheduler"} <= set(extra):
            raise ValueError(f"{cfg.resume}: a checkpoint without the trainer's step and "
                             "schedule (saved by zs.save without extra={'step': ..., "
                             "'scheduler': ...}?); start from its weights with --init-from "
                             "after `zeroshard export`, or resume a checkpoint of zeroshard train")
        start = extra["step"]
        if start >= cfg.steps:  # found before launch under zeroshard train; not under torchrun
            raise ValueError(f"resume={cfg.resume!r}: {ckpt} is at step {start} and steps="
                             f"{cfg.steps}: nothing to train; give --steps above {start}")
        scheduler.load_state_dict(extra["scheduler"])
        if scaler.enabled and "loss_scaler" in extra:  # fp16: the scale and its counters
            scaler.load_state_dict(extra["loss_scaler"])
        out.note(f"resumed from {ckpt} (step {start}): weights, optimizer state, schedule")
    first_eval = evaluate(model, source, corpus, cfg, "val", rank, world, seq_len)
    out.start(first_eval, start)
    board = Board(cfg.tensorboard, rank == 0, purge_step=start if start else None)
    board.start(first_eval, start)
    board.watch(model, optimizer)
    tokens_per_step = cfg.batch * seq_len
    model.comm_stats(reset=True)
    comm: dict[str, dict[str, int]] = {}  # training steps only, evaluations left out
    in_a_row = 0  # consecutive steps skipped for non-finite gradients
    try:
        held: list[dict[str, int]] = []
        for step in range(start, cfg.steps):
            if step == cfg.steps - 1:  # the memory summary is read where every category is
                # live: after the last backward, once the engine has landed its reductions;
                # the optimizer's state after the step (a first step creates it)
                optimizer.register_step_pre_hook(
                    lambda o, a, k: held.append(model.memory(o)) if not held else None)
                optimizer.register_step_post_hook(
                    lambda o, a, k: held[0].update(optimizer=model.memory(o)["optimizer"]))
            if model.profiler is not None:  # steps 2-3: the gather order is recorded by then
                model.profiler.enabled = start + 1 <= step < start + 3
            t0 = time.perf_counter()
            base = rank * cfg.batch // world
            x, y = corpus.batch("train", cfg.seed, step, cfg.batch, seq_len,
                                part=slice(base, base + micro * accum))
            step_loss = torch.zeros((), device=device)
            for m in range(accum):
                rows = slice(m * micro, (m + 1) * micro)
                loss = source.loss(model, x[rows].to(device), y[rows].to(device)) / accum
                scaler.scale(loss).backward()
                step_loss += loss.detach().float()
            scaler.unscale_(optimizer)
            norm = model.clip_grad_norm_(cfg.clip) if cfg.clip else None
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()
            loss_value = _global_mean(step_loss, world)
            in_a_row = in_a_row + 1 if model.last_step_skipped else 0
            if in_a_row:
                out.skipped(step + 1, in_a_row, model.skipped_steps)
            if in_a_row >= cfg.max_skipped:
                raise FloatingPointError(
                    f"{in_a_row} steps in a row (to step {step + 1}) were skipped for "
                    f"non-finite gradients (max_skipped={cfg.max_skipped}); the weights are "
                    "those of the last good step. Lower --lr, check the data, or resume the "
                    "last checkpoint")
            dt = time.perf_counter() - t0
            losses.append(loss_value)
            for kind, s in model.comm_stats(reset=True).items():
                acc = comm.setdefault(kind, {"calls": 0, "bytes": 0})
                acc["calls"] += s["calls"]
                acc["bytes"] += s["bytes"]
            record = {"step": step + 1, "loss": loss_value, "lr": scheduler.get_last_lr()[0],
                      "grad_norm": None if norm is None else norm.item(),
                      "skipped": model.last_step_skipped,
                      "tokens_per_s": tokens_per_step / dt, "step_time_s": dt}
            if scaler.enabled:
                record["loss_scale"] = scaler.get_scale()
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                record["train_loss"] = evaluate(model, source, corpus, cfg, "train", rank, world,
                                                seq_len)
                record["val_loss"] = evaluate(model, source, corpus, cfg, "val", rank, world,
                                              seq_len)
                evals.append((step + 1, record["train_loss"], record["val_loss"]))
                out.eval_line(record)
                model.comm_stats(reset=True)
            out.step(record)
            board.step(record, model.skipped_steps)
            if cfg.save_dir and ((cfg.save_every and (step + 1) % cfg.save_every == 0)
                                 or step + 1 == cfg.steps):
                _save(model, optimizer, cfg, step + 1,
                      {"step": step + 1, "scheduler": scheduler.state_dict(),
                       "config": _saved_config(cfg),
                       **({"loss_scaler": scaler.state_dict()} if scaler.enabled else {})},
                      out)
                model.comm_stats(reset=True)
            if log:
                log.write(json.dumps(record) + "\n")
                log.flush()
    finally:
        out.stop()
        board.close()
        if log:
            log.close()
    if model.profiler is not None:
        model.profiler.enabled = False
        profile_report(model, cfg, source, micro, seq_len, rank, out)
    memories = [None] * world
    dist.all_gather_object(memories, held[0] if held else model.memory(optimizer))
    out.summary(memories, comm, model.zero_config, layout(model), unit_params)
    if cfg.sample_chars:
        model.eval()
        out.sample(source.sample(model, device))
    return {"losses": losses, "evals": evals, "first_val": first_eval,
            "memory": memories[rank], "loss_scale": scaler.get_scale()}
