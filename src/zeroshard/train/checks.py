"""The values of a ``TrainConfig`` checked at its construction: each type, then each
value against what the run can use, the ends of their types included (an infinite
learning rate trains nothing, an empty path saves nothing, a seed past 2**32 stops
every rank at its first batch). One ValueError names the setting, the value and what
is accepted; ``train/flags.py`` turns the setting's name into the flag or the key the
user typed."""

from __future__ import annotations

import math
from dataclasses import fields

from ..models.gpt import PRESETS

#: What each annotated type accepts, in the words of an error.
_TYPES = {"int": ((int,), "an integer"), "float": ((int, float), "a number"),
          "str": ((str,), "a string"), "dict": ((dict,), "a JSON object"),
          "list": ((list, tuple), "a list")}

#: Shortest --timeout: every wait is bounded by it, the ranks' first meeting (all of them
#: started and connected to each other) included, which takes a few seconds.
MIN_TIMEOUT = 2.0

#: Longest --timeout: past it a wait is as good as none (and timedelta overflows).
MAX_TIMEOUT = 1e9

#: Seeds the batches' and the weights' generators take (the batch of a step is drawn
#: from seed * 1,000,003 + step, which must stay below 2**64).
MAX_SEED = 2**32 - 1

#: Most text sampled at the end: one forward pass per byte (or per token).
MAX_SAMPLE = 100_000

#: Settings that name a path (an empty one is an unset variable, never the current folder).
PATHS = ("json_log", "save_dir", "resume", "profile", "init_from", "hf_model", "data",
         "tensorboard", "data_field")


def check_types(cfg) -> None:
    """A ValueError naming the first trainer field whose value is not of its annotated
    type (JSON gives strings where numbers belong, numbers where paths do)."""
    for f in fields(cfg):
        if f.name == "zero":
            continue
        value, kinds = getattr(cfg, f.name), [k.strip() for k in f.type.split("|")]
        if value is None and "None" in kinds:
            continue
        accepted = [_TYPES[k] for k in kinds if k in _TYPES]
        if not any(isinstance(value, t) and not isinstance(value, bool) for t, _ in accepted):
            words = " or ".join([w for _, w in accepted] + (["null"] if "None" in kinds else []))
            raise ValueError(f"{f.name}={value!r} must be {words}")


def _positive(cfg, name: str, allow_none: bool = False) -> None:
    value = getattr(cfg, name)
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive number")
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite positive number")


def check_values(cfg) -> None:
    """Every value of ``cfg`` (types first) against what a run can use."""
    check_types(cfg)
    for name in ("nproc", "steps", "batch", "lr", "eval_every", "eval_batches", "timeout",
                 "max_skipped", "tp"):
        _positive(cfg, name)
    for name in ("micro_batch", "clip", "warmup", "save_every", "keep_last", "seq_len"):
        _positive(cfg, name, allow_none=True)
    for name in PATHS:
        if getattr(cfg, name) == "":
            raise ValueError(f"{name}='' is empty (an unset shell variable?); give a value, or "
                             f"{'leave it out' if name == 'data_field' else 'null for none'}")
    if cfg.timeout < MIN_TIMEOUT:
        raise ValueError(f"timeout={cfg.timeout!r} s is too short for the ranks to start and "
                         "meet (every wait is bounded by it, their first included); give at "
                         f"least {MIN_TIMEOUT:g} seconds (default 300)")
    if cfg.timeout > MAX_TIMEOUT:
        raise ValueError(f"timeout={cfg.timeout!r} s is longer than a wait can be; give at most "
                         f"{MAX_TIMEOUT:g} seconds (default 300)")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise ValueError(f"seed={cfg.seed} must be an integer from 0 to {MAX_SEED}")
    if cfg.data and not cfg.hf_model:
        raise ValueError(f"data={cfg.data!r} needs hf_model: the built-in GPT reads bytes "
                         "of its built-in corpus; give --hf-model DIR to train on your text")
    if not 0 < cfg.val_fraction <= 0.5:
        raise ValueError(f"val_fraction={cfg.val_fraction!r} is outside (0, 0.5]; give "
                         "the share of the data held out for validation, e.g. 0.05")
    if cfg.model not in PRESETS:
        raise ValueError(f"model={cfg.model!r}; expected one of {', '.join(PRESETS)}")
    if cfg.resume in ("latest", "auto") and not cfg.save_dir:
        raise ValueError(f"resume={cfg.resume!r} needs save_dir")
    if (cfg.keep_last or cfg.save_every) and not cfg.save_dir:
        raise ValueError(f"{'keep_last' if cfg.keep_last else 'save_every'} needs "
                         "save_dir, the folder the checkpoints go to")
    if cfg.resume and cfg.resume != "auto" and cfg.init_from:  # auto: init_from first
        raise ValueError(f"resume={cfg.resume!r} and init_from={cfg.init_from!r} contradict "
                         "each other; give one")
    for name in ("sample_chars", "weight_decay"):
        value = getattr(cfg, name)
        if value < 0:
            raise ValueError(f"{name}={value!r} must be >= 0")
        if not math.isfinite(value):
            raise ValueError(f"{name}={value!r} must be a finite number >= 0")
    if cfg.sample_chars > MAX_SAMPLE:
        raise ValueError(f"sample_chars={cfg.sample_chars} is more than the sample takes: at "
                         f"most {MAX_SAMPLE:,} (one forward pass per byte)")
