"""Which optimizers may step a shard.

ZeRO-1 and beyond rely on the update being elementwise: each element's new value
depends only on that element's weight, gradient and state, so rank r can update its
slice alone and the result equals the unsharded update exactly (ZeRO paper, section
5.1). An optimizer that looks across elements — a trust ratio over the whole tensor
(LAMB, LARS), factored second moments over rows and columns (Adafactor), an
orthogonalised matrix update (Muon), a line search over the whole model (LBFGS) —
would see only a slice and compute something else, silently.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from .clip import redirect_torch_clip

ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop",
               "Rprop", "ASGD", "Adadelta", "SparseAdam"}

NOT_ELEMENTWISE = {
    "LBFGS": "it runs a line search over the whole model's flattened parameters",
    "Adafactor": "its factored second moment averages over whole rows and columns",
    "Muon": "it orthogonalises each whole weight matrix",
    "Lamb": "its trust ratio divides the norm of the whole weight by the whole update",
    "LAMB": "its trust ratio divides the norm of the whole weight by the whole update",
    "FusedLamb": "its trust ratio divides the norm of the whole weight by the whole update",
    "LARS": "its trust ratio divides the norm of the whole weight by the whole gradient",
    "Shampoo": "its preconditioners are built from whole matrices",
}

_warned: set[str] = set()


def check_optimizer(optimizer: torch.optim.Optimizer, policy) -> None:
    """Refuse an optimizer whose update is not elementwise where it steps slices."""
    name = type(optimizer).__name__
    stage = policy.stage
    if not policy.checks_elementwise or name in ELEMENTWISE:
        return
    if name in NOT_ELEMENTWISE:
        raise ValueError(
            f"{name} cannot step ZeRO stage {stage} shards: {NOT_ELEMENTWISE[name]}, and each "
            "rank holds only a slice of every parameter, so the update would differ from the "
            "unsharded one. Use stage 0, or an elementwise optimizer "
            f"({', '.join(sorted(ELEMENTWISE))})")
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"zeroshard cannot tell whether {name} updates each element independently; at "
            f"stage {stage} each rank steps a slice, which is exact only for elementwise "
            "updates", stacklevel=3)


LIVE: weakref.WeakSet = weakref.WeakSet()
_HOOKS: list = []


def _owners(optimizer):
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    owners = []
    for m in list(LIVE):
        if m.holds_any(ids):
            owners.append(m)
        elif m.holds_original(ids):
            raise ValueError(
                f"{type(optimizer).__name__} holds the module's own parameters (from before "
                "zs.shard(), or model.module.parameters()): those do not train (each rank "
                "steps its shards). Build the optimizer after sharding, over "
                "model.parameters()")
    return owners


def _pre_step(optimizer, args, kwargs) -> None:
    for m in _owners(optimizer):
        m.stepper.before_step(optimizer)


def _post_step(optimizer, args, kwargs) -> None:
    for m in _owners(optimizer):
        m.stepper.after_step()


def register_for_step_hooks(model) -> None:
    """Let ``model.stepper.before_step(opt)`` / ``after_step()`` run around every step
    of an optimizer that holds its shards (and ``torch.nn.utils.clip_grad_norm_`` clip
    its shards by the global norm, ``clip.py``). The hooks are installed once per process:
    every torch optimizer's step passes through them, and they act only for the live
    sharded models whose shards that optimizer holds."""
    LIVE.add(model)
    redirect_torch_clip(LIVE)
    if not _HOOKS:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )
        _HOOKS.append(register_optimizer_step_pre_hook(_pre_step))
        _HOOKS.append(register_optimizer_step_post_hook(_post_step))
