"""Where a run of ``zeroshard train`` starts: from a checkpoint (its weights, optimizer
state, schedule, loss scale, skipped-step counters and step), from consolidated weights
(``init_from``), or from the model's own weights at step 0.

What to resume is decided here once (``checkpoint_to_resume``), before the model is
built, and acted on here once (``resume``): "auto", the save folder's latest checkpoint
when there is one, else a first start, is this module's rule alone, so one command
serves a first start and every restart of it.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..checkpoint.consolidated import load_pretrained
from ..checkpoint.load import load, load_weights
from ..checkpoint.sharded import LATEST, MANIFEST, read_manifest, resolve
from . import restart
from .run import Run
from .save import saved_config
from .settings import TrainConfig

#: The settings that make a checkpoint another run's for "auto": the model, the data,
#: and what picks each step's rows of it (the seed and the global batch). The rest (N,
#: the stage, the precision, the step count) may change between a run's restarts.
SAME_RUN = ("model", "hf_model", "data", "seq_len", "seed", "batch")


def checkpoint_to_resume(cfg: TrainConfig) -> str | Path | None:
    """The checkpoint this run resumes: ``cfg.resume``'s path, for "latest" the save
    folder (whose ``latest`` names it), for "auto" the save folder's latest checkpoint
    when it has one; None for a first start. Set-up asks before it builds the model:
    weights a checkpoint replaces are not read, and a resumed run's JSON log is
    appended to."""
    if not cfg.resume:
        return None
    if cfg.resume == "auto":
        return _latest_of_this_run(cfg)
    return Path(cfg.save_dir) if cfg.resume == "latest" else cfg.resume


def _latest_of_this_run(cfg: TrainConfig) -> Path | None:
    """"auto": the checkpoint the save folder's ``latest`` names; None where no save has
    completed (no folder yet, or a run stopped in its first save: only a ``.partial``
    copy). A folder holding another run's checkpoints is refused, not overwritten."""
    folder = Path(cfg.save_dir)
    if not (folder / LATEST).exists() and not (folder / MANIFEST).exists():
        return None
    ckpt = resolve(folder)
    saved = read_manifest(ckpt)["extra"].get("config")
    if not isinstance(saved, dict):  # not the trainer's: the preflight names it
        return ckpt
    ours = saved_config(cfg)
    for key in SAME_RUN:
        if key == "model" and (saved.get("hf_model") or ours["hf_model"]):
            continue  # the preset is unused beside a model folder
        if _same(key, saved.get(key)) != _same(key, ours[key]):
            raise ValueError(
                f"resume='auto': save_dir={cfg.save_dir!r} holds another run's checkpoints: "
                f"{ckpt.name} was trained with {key}={saved.get(key)!r}, this run has "
                f"{key}={ours[key]!r}; give this run its own --save-dir")
    return ckpt


def _same(key: str, value):
    """A setting as compared: a path as the file it names (from the working folder)."""
    if key in ("hf_model", "data") and isinstance(value, str):
        return str(Path(value).expanduser().resolve())
    return value


def weights_checkpoint(path: str | Path) -> bool:
    """Whether ``init_from`` names a zeroshard checkpoint (a folder with a manifest, or a
    save folder with ``latest``) rather than safetensors weights."""
    path = Path(path)
    return path.is_dir() and ((path / MANIFEST).is_file() or (path / LATEST).is_file()) \
        or (path.name == LATEST and path.is_file())


def resume(run: Run) -> int:
    """Resume if there is something to resume: ``run.checkpoint``'s weights, optimizer
    state, schedule, loss scale and skipped-step counters, or ``init_from``'s weights.
    A restart, or a world other than the checkpoint's, is said in one line
    (``restart.py``). Returns the step to start from (0: a first start)."""
    cfg, out = run.cfg, run.out
    began = time.perf_counter()
    restarts = restart.gather(run)
    if run.checkpoint is None:
        if cfg.init_from and weights_checkpoint(cfg.init_from):  # its weights alone
            load_weights(run.model, cfg.init_from)
            out.note(f"loaded the weights of checkpoint {resolve(cfg.init_from)}")
        elif cfg.init_from:
            load_pretrained(run.model, cfg.init_from)
            out.note(f"loaded weights from {cfg.init_from}")
        restart.announce(run, None, {}, restarts, time.perf_counter() - began)
        return 0
    extra = load(run.model, run.optimizer, run.checkpoint)  # every rank agrees before any raises
    ckpt = resolve(run.checkpoint)
    if not {"step", "scheduler"} <= set(extra):
        raise ValueError(f"{cfg.resume}: a checkpoint without the trainer's step and "
                         "schedule (saved by zs.save without extra={'step': ..., "
                         "'scheduler': ...}?); start from its weights with --init-from "
                         "after `zeroshard export`, or resume a checkpoint of zeroshard train")
    start = extra["step"]
    if start >= cfg.steps and cfg.resume != "auto":  # found before launch under zeroshard train
        raise ValueError(f"resume={cfg.resume!r}: {ckpt} is at step {start} and steps="
                         f"{cfg.steps}: nothing to train; give --steps above {start}")
    run.scheduler.load_state_dict(extra["scheduler"])
    if run.scaler.enabled and "loss_scaler" in extra:  # fp16: the scale and its counters
        run.scaler.load_state_dict(extra["loss_scaler"])
    run.skipped_before = extra.get("skipped_steps", 0)
    run.skipped_in_a_row = extra.get("skipped_in_a_row", 0)
    restart.announce(run, ckpt, extra, restarts, time.perf_counter() - began)
    return start
