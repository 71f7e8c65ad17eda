"""Which optimizers may step a shard, and how.

ZeRO-1 and beyond give each rank some rows of every parameter. An elementwise update
(each element's new value depends only on that element's weight, gradient and state) is
exact on them: torch's own step runs on the rows (ZeRO paper, section 5.1). An update
that reads more is classified once per optimizer ([Note: optimizer needs] in
``spec/optimizers.py``): sums over whole tensors (Adafactor, LAMB) are completed by one
small all-reduce a round (``reduced.py``); whole-matrix updates (Muon) are computed by
an owner per matrix (``matrix.py``). Either way the engine runs the step in the
optimizer's pre-hook with torch's own maths on the optimizer's own param groups and
state, and leaves its ``step()`` no gradient to act on. Anything else is refused: its
update would differ from the unsharded one, silently.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from ...spec.optimizers import ELEMENTWISE, REFUSED, STEPPED, Need, supported
from .clip import redirect_torch_clip

_warned: set[str] = set()


def _stepped_class(name: str):
    """The one class the engine steps under ``name`` (a subclass may step otherwise)."""
    if name == "Lamb":
        from ...optim.lamb import Lamb
        return Lamb
    return getattr(torch.optim, name, None)


def sharded_step(optimizer: torch.optim.Optimizer, stepper):
    """The engine's step of ``optimizer`` on the stepper's shards, or None where the
    optimizer's own step is exact (whole parameters, or an elementwise update); a
    ValueError for an optimizer that cannot step shards."""
    name = type(optimizer).__name__
    stage = stepper.policy.stage
    if stepper.comm.mesh.tp_world > 1 and (name in STEPPED or name in REFUSED):
        # a split matrix is a slice on each tp rank at every stage: its sums and its
        # orthogonalisation would be of the slice (FSDP2 + TP's Muon steps so, silently)
        why = STEPPED[name][1] if name in STEPPED else REFUSED[name]
        raise ValueError(
            f"{name} beside tensor parallelism (tp={stepper.comm.mesh.tp_world}): its "
            f"update reads {why}, and each tp rank holds a slice of every matrix tensor "
            "parallelism splits, so it would step another function. Use an elementwise "
            "optimizer (AdamW, Adam, SGD) beside tensor parallelism, or tp = 1")
    if (not stepper.policy.checks_elementwise or stepper.comm.mesh.shard_world == 1
            or name in ELEMENTWISE):
        return None
    if name in STEPPED and type(optimizer) is _stepped_class(name):
        if STEPPED[name][0] is Need.WHOLE_MATRIX:
            from .matrix import MatrixStep
            return MatrixStep(optimizer, stepper)
        from .reduced import ReducedStep
        return ReducedStep(optimizer, stepper)
    why = REFUSED.get(name) or (STEPPED[name][1] + ", and this is not the class zeroshard "
                                "steps under that name" if name in STEPPED else None)
    if why is not None:
        raise ValueError(
            f"{name} cannot step ZeRO stage {stage} shards: {why}, and each rank holds only "
            "some rows of every parameter, so the update would differ from the unsharded "
            f"one. Use stage 0, or an optimizer zeroshard steps on shards ({supported()})")
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"zeroshard cannot tell whether {name} updates each element independently; at "
            f"stage {stage} each rank steps some rows, which is exact only for elementwise "
            f"updates (stepped exactly: {supported()})", stacklevel=3)
    return None


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
        m.stepper.after_step(optimizer)


def register_for_step_hooks(model) -> None:
    """Let ``model.stepper.before_step(opt)`` / ``after_step(opt)`` run around every step
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
