"""DeepSpeed's ``optimizer`` and ``scheduler`` sections, built as torch objects.

A Trainer given a DeepSpeed config with these sections lets DeepSpeed build them
(``deepspeed_optim_sched`` in ``transformers/integrations/deepspeed.py``). zeroshard
builds the same: DeepSpeed's Adam/AdamW over every trainable parameter in one group
(DeepSpeed receives the parameters, not the Trainer's decay groups), and its
``WarmupLR`` / ``WarmupDecayLR`` as a torch ``LRScheduler`` that sets the learning rates
DeepSpeed's would (``deepspeed/runtime/lr_schedules.py``).
"""

from __future__ import annotations

import math

import torch

from ..spec.deepspeed import DEEPSPEED_ADAM

#: DeepSpeed's defaults for its Adam, which torch's differ from.
_ADAM_DEFAULTS = DEEPSPEED_ADAM
#: Params DeepSpeed reads to pick its implementation, not the update.
_IMPLEMENTATION = ("torch_adam", "adam_w_mode", "fused")


def deepspeed_optimizer(section: dict, params) -> torch.optim.Optimizer:
    """The optimizer a DeepSpeed ``optimizer`` section makes, over ``params`` (every
    trainable parameter, one group). ``Adam`` steps as AdamW unless ``adam_w_mode`` is
    false (DeepSpeed's ``_configure_basic_optimizer``)."""
    given = dict(section.get("params", {}))
    unknown = sorted(set(given) - set(_ADAM_DEFAULTS) - set(_IMPLEMENTATION) - {"amsgrad"})
    if unknown:
        raise ValueError(f"DeepSpeed config optimizer.params has {unknown}, which its "
                         f"{section['type']} does not take; accepted: "
                         f"{sorted([*_ADAM_DEFAULTS, 'amsgrad', *_IMPLEMENTATION])}")
    decoupled = section["type"].lower() == "adamw" or given.get("adam_w_mode", True)
    kwargs = {**_ADAM_DEFAULTS, **{k: v for k, v in given.items() if k not in _IMPLEMENTATION}}
    kwargs["betas"] = tuple(kwargs["betas"])
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls([p for p in params if p.requires_grad], **kwargs)


class DeepSpeedWarmup(torch.optim.lr_scheduler.LRScheduler):
    """DeepSpeed's ``WarmupLR`` (``total_num_steps`` None) or ``WarmupDecayLR``: from
    ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` (at least 2), by a
    log or linear curve, then constant or decaying linearly to 0 at ``total_num_steps``.

    DeepSpeed counts its iterations from -1 at construction (the minimum lr) and its engine
    steps it after each optimizer step; torch's count starts at 0. So the lr of optimizer
    step k (1-based) is DeepSpeed's at iteration k - 2, ``_lr(self.last_epoch - 1)``."""

    def __init__(self, optimizer, warmup_min_lr: float = 0.0, warmup_max_lr=None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log",
                 total_num_steps: int | None = None, last_epoch: int = -1):
        if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or (
                warmup_num_steps <= 0):
            raise ValueError(f"DeepSpeed config scheduler.params.warmup_num_steps="
                             f"{warmup_num_steps!r}; expected a positive integer")
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"DeepSpeed config scheduler.params.warmup_type={warmup_type!r}; "
                             "expected 'log' or 'linear'")
        groups = optimizer.param_groups
        self.min_lrs = _per_group(warmup_min_lr, groups)
        self.max_lrs = _per_group([g["lr"] for g in groups] if warmup_max_lr is None
                                  else warmup_max_lr, groups)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, last_epoch)

    def _gamma(self, it: int) -> float:
        """``WarmupLR._get_gamma`` / ``WarmupDecayLR._get_gamma`` at iteration ``it``."""
        w = self.warmup_num_steps
        if it < w:
            if self.warmup_type == "log":
                return math.log(it + 1) / math.log(w)
            return it / w
        if self.total_num_steps is None:
            return 1.0
        return max(0.0, (self.total_num_steps - it) / max(1.0, self.total_num_steps - w))

    def get_lr(self) -> list[float]:
        it = self.last_epoch - 1
        if it < 0:
            return list(self.min_lrs)
        gamma = self._gamma(it)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


def deepspeed_scheduler(section: dict, optimizer) -> DeepSpeedWarmup:
    """The scheduler a DeepSpeed ``scheduler`` section makes (its step counts filled)."""
    params = dict(section.get("params", {}))
    known = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"}
    decay = section["type"].lower() == "warmupdecaylr"
    if decay:
        known.add("total_num_steps")
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"DeepSpeed config scheduler.params has {unknown}, which "
                         f"{section['type']} does not take; accepted: {sorted(known)}")
    if decay and "total_num_steps" not in params:
        raise ValueError("DeepSpeed config scheduler WarmupDecayLR needs "
                         "params.total_num_steps (or \"auto\")")
    return DeepSpeedWarmup(optimizer, **params)


def _per_group(value, groups) -> list[float]:
    """DeepSpeed's ``_format_param``: one value for every group, or one per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(groups):
            raise ValueError(f"DeepSpeed config scheduler: {len(value)} learning rates for "
                             f"{len(groups)} param groups")
        return [float(v) for v in value]
    return [float(value)] * len(groups)
