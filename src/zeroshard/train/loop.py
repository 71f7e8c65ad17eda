"""The training loop that runs on every rank of ``zeroshard train``, in parts: set-up
(here), resume (``resume.py``), the step and evaluation (``step.py``), saving
(``save.py``) and the end (here). They share one ``Run`` (``run.py``)."""

from __future__ import annotations

import contextlib
import json

import torch
import torch.distributed as dist

from .._paths import folder
from ..runtime.dist import default_device, init_distributed
from ..runtime.scaler import GradScaler
from ..runtime.unit import local
from .board import Board
from .datasource import open_source
from .hfmodel import model_source
from .lrschedule import lr_lambda
from .optimizer import build_optimizer, schedule
from .peftmodel import compile_units, trainable_count
from .profile import profile_report
from .report import Reporter, layout
from .restart import restarted
from .resume import checkpoint_to_resume, resume
from .run import Run
from .save import save, save_due
from .settings import TrainConfig
from .step import evaluate, evaluation, evaluation_due, train_step


def train(cfg: TrainConfig) -> dict:
    """Run the whole job on this rank; rank 0 prints. Returns the losses (for tests)."""
    run = set_up(cfg)
    run.start = resume(run)
    _begin(run)
    try:
        for step in range(run.start, cfg.steps):
            record = train_step(run, step)
            if evaluation_due(cfg, step + 1):
                evaluation(run, record)
            run.out.step(record)
            run.board.step(record, run.skipped_steps)
            if save_due(cfg, step + 1):
                save(run, step + 1)
            if run.log:
                _log(run, record)
    finally:
        run.out.stop()
        run.board.close()
        if run.log:
            with contextlib.suppress(OSError):  # (a log that failed is told by _log)
                run.log.close()
    return finish(run)


def _log(run: Run, record: dict) -> None:
    """The step's line in the JSON log, written through: a log that cannot be written
    any more (a full disk) stops the run, naming it and the step."""
    try:
        run.log.write(json.dumps(record) + "\n")
        run.log.flush()
    except OSError as exc:
        raise OSError(exc.errno, f"{exc.strerror or exc} at step {record['step']}, so the run "
                      "stopped there (checkpoints saved before it are complete)",
                      f"--json-log={run.cfg.json_log}") from None


def set_up(cfg: TrainConfig) -> Run:
    """This rank's run: the process group, the model (its own weights not read where a
    checkpoint replaces them), the optimizer, the schedule, the loss scaler, the data, the
    reporter (the header printed) and the JSON log."""
    rank, world = init_distributed(timeout_s=cfg.timeout)
    device = default_device()  # batches are made on the host, the same on every rank
    micro, accum = cfg.accumulation(world)  # per data-parallel rank beside TP
    for name in ("save_dir", "profile"):  # under torchrun no launcher checked them
        if getattr(cfg, name):
            folder(name, getattr(cfg, name))
    checkpoint = checkpoint_to_resume(cfg)
    source = model_source(cfg)
    # torch seeds its global generator at random at start-up: a model's dropout (GPT-2's)
    # would differ between two runs of one command (a resume restores the saved state)
    torch.manual_seed(cfg.seed)
    model = source.build(load_weights=not (checkpoint or cfg.init_from))
    compile_units(model, cfg)  # --compile: each unit's forward (train/peftmodel.py)
    if model.profiler is not None:
        model.profiler.enabled = False
    optimizer = build_optimizer(model, cfg)  # one, or Muon's pair (train/optimizer.py)
    scheduler = schedule(optimizer, lr_lambda(cfg))
    # fp16: dynamic loss scaling, every rank alike (skipped steps count as skips)
    fp16 = model.zero_config.recipe.param_dtype == "fp16"
    scaler = (GradScaler.from_deepspeed(model, {"fp16": cfg.loss_scaler})
              if fp16 and cfg.loss_scaler is not None else GradScaler(model, enabled=fp16))
    corpus = open_source(cfg, source.vocab, source.seq_len, rank)
    # per unit, what one rank holds times tp (plan/tp.py's count; the parameters at tp = 1)
    unit_params = [cfg.tp * sum(local(p).numel() for p in u.params) for u in model.units]
    out = Reporter(cfg, world, micro, accum, source.params(), enabled=rank == 0,
                   label=source.label, origin=source.source)
    out.trainable = trainable_count(model)  # --lora: the adapters alone train
    log = (open(cfg.json_log, "a" if checkpoint or restarted() else "w", encoding="utf-8")
           if cfg.json_log and rank == 0 else None)
    out.header()
    return Run(cfg, rank, world, device, micro, accum, source, model, optimizer, scheduler,
               scaler, corpus, out, unit_params, checkpoint, log)



def _begin(run: Run) -> None:
    """The first evaluation, said at the step the run starts from; TensorBoard's writer
    (a resumed run's later points purged). The steps' traffic is counted from here."""
    run.first_eval = evaluate(run, "val")
    run.out.start(run.first_eval, run.start)
    run.board = Board(run.cfg.tensorboard, run.rank == 0,
                      purge_step=run.start if run.start else None)
    run.board.start(run.first_eval, run.start)
    run.board.watch(run.model, run.optimizer)
    run.model.comm_stats(reset=True)


def finish(run: Run) -> dict:
    """The end: the profile report, the memory summary, the sample. Returns the losses,
    the evaluations, the first validation loss, this rank's memory and the loss scale."""
    model, cfg = run.model, run.cfg
    if model.profiler is not None:
        model.profiler.enabled = False
        profile_report(model, cfg, run.source, run.micro, run.seq_len, run.rank, run.out)
    memories = [None] * run.world
    dist.all_gather_object(memories, run.held[0] if run.held else model.memory(run.optimizer))
    run.out.summary(memories, run.comm, model.zero_config, layout(model), run.unit_params,
                    _tp_planned(run))
    if cfg.sample_chars:
        model.eval()
        with model.inference():  # the whole model gathered once, where it fits
            run.out.sample(run.source.sample(model, run.device))
    return {"losses": run.losses, "evals": run.evals, "first_val": run.first_eval,
            "memory": memories[run.rank], "loss_scale": run.scaler.get_scale()}


def _tp_planned(run: Run) -> int:
    """Tensor parallelism's own bytes per step as the planner counts them (``plan/tp.py``:
    the plan's activation collectives), for the summary beside the ledger's."""
    if run.cfg.tp == 1:
        return 0
    from ..plan.arch import ModelSpec
    from ..plan.workload import Workload, tp_comm_bytes

    mode = run.model.zero_config.activation_checkpointing  # a recompute all-reduces again
    work = Workload.of_mode(run.micro * run.seq_len, run.seq_len,
                            mode if run.model.checkpointed_units else "none")
    return run.accum * tp_comm_bytes(ModelSpec.from_arch(run.source.architecture()),
                                     run.model.zero_config.recipe, work, run.cfg.tp)
