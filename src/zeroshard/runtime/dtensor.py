"""The sharded model's and its optimizer's state dicts in torch's terms: DTensors on
the shard group's mesh, which ``torch.distributed.checkpoint`` and FSDP2 read.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from ..spec.optimizers import whole_state
from .unit import held, local_rows, to_dtensor

# ----------------------------------------------------------------------------------------
# A sharded model's state dict in torch's terms: DTensors.
#
# [Note: state dict] ``state_dict()`` returns, without a collective, under each of the
# module's own names (tied names each, as torch does), what this rank holds of that
# parameter as a DTensor of the full shape on the shard group's device mesh
# (``unit.py``, [Note: DTensor layout]): the fp32 master rows where there is a
# master, else the weights; ``Shard(0)`` where sharded, ``Replicate()`` where whole; and
# the module's persistent buffers as plain tensors (replicated, as DDP keeps them). The
# DTensors share memory with what the model holds, as FSDP2's do, so
# ``torch.distributed.checkpoint`` loads in place; FSDP2 returns the same layout, which is
# why DCP can save one and load the other, reshard across world sizes and stages, and why
# ``get_model_state_dict`` / ``set_model_state_dict`` work on a sharded model.
#
# ``torch.save(model.state_dict())`` on every rank is a sharded checkpoint of the weights
# (each rank's file holds its rows). ``full_state_dict()`` gathers full weights;
# ``zeroshard.save`` writes a resharding checkpoint with the optimizer state.
#
# ``load_state_dict()`` takes, per parameter, a DTensor (any mesh and placements: its
# local tensor where laid out as ours, else gathered whole), the full tensor (an unsharded
# model's state dict) or this rank's rows, checks every shape before it writes anything,
# writes the master (or weights) and then brings the compute weights up to date from it —
# a collective at stages 1-2, like the step. The same values then load through the
# module itself (``guard.py``).
# ----------------------------------------------------------------------------------------

def owners(model) -> dict[int, tuple]:
    """Id of every tensor the module may register for a parameter (the full parameter,
    or the DTensor a released unit shows) -> (unit, index)."""
    out = {}
    for u in model.units:
        for i, p in enumerate(u.params):
            out[id(p)] = (u, i)
        for i, p in enumerate(u.view.sharded or ()):
            out[id(p)] = (u, i)
    return out


def state_dict_of(model, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
    """What this rank holds, as DTensors, and the persistent buffers (see the note).
    ``keep_vars`` keeps buffers as they are; parameters are DTensors either way."""
    out = OrderedDict() if destination is None else destination
    by_id = owners(model)
    for key, t in model.module.state_dict(keep_vars=True).items():
        if id(t) in by_id:
            u, i = by_id[id(t)]
            out[prefix + key] = to_dtensor(u, i, held(u, i)[0])
        else:
            out[prefix + key] = t if keep_vars else t.detach()
    return out


def load_into(model, values: dict, strict: bool = True) -> _IncompatibleKeys:
    """Write ``values`` (DTensors, full tensors or this rank's rows, per key) into what
    the model holds; master, shards and compute weights agree afterwards."""
    expected = model.module.state_dict(keep_vars=True)
    missing = [k for k in expected if k not in values]
    unexpected = [k for k in values if k not in expected]
    if strict and (missing or unexpected):
        raise ValueError(f"load_state_dict: missing keys {missing}, unexpected keys "
                         f"{unexpected}; the keys are the module's own names (as "
                         "state_dict() returns them); strict=False loads the rest")
    by_id = owners(model)
    writes = []
    for key, t in expected.items():
        if key not in values:
            continue
        if id(t) in by_id:
            u, i = by_id[id(t)]
            rows = local_rows(u, i, values[key], f"load_state_dict: {key!r}")
            writes.append((held(u, i)[0], rows))
            continue
        value = values[key]  # a buffer
        value = value.full_tensor() if isinstance(value, DTensor) else torch.as_tensor(value)
        if value.shape != t.shape:
            raise ValueError(f"load_state_dict: buffer {key!r} has shape "
                             f"{tuple(value.shape)}, the model's {tuple(t.shape)}")
        writes.append((t, value))
    with torch.no_grad():
        for target, value in writes:
            target.copy_(value)
    model.refresh_compute()
    return _IncompatibleKeys(missing, unexpected)


# ----------------------------------------------------------------------------------------
# The optimizer's state dict in torch's terms: the moments of a shard as DTensors.
#
# [Note: optimizer state dict] An elementwise optimizer keeps, per shard, state tensors of
# the shard's shape (Adam's ``exp_avg``, ``exp_avg_sq``): this rank's rows of the
# parameter's moments. Its own ``state_dict()`` returns them as plain tensors, which
# ``torch.distributed.checkpoint`` takes for replicated: it would keep one rank's rows for
# every rank. So a sharded model registers on every optimizer that steps its shards a
# state-dict post-hook that returns each per-element state of its shards as a DTensor with
# the parameter's own layout (``unit.py``), sharing memory (DCP loads in place),
# and a load pre-hook that takes DTensors, full tensors or this rank's rows back to this
# rank's rows. Scalars (Adam's ``step``) are the same on every rank and stay as they are.
# This is what FSDP2's optimizer state is (its parameters are DTensors, so their state
# is), and what ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` and
# torchtitan's checkpointer expect.
#
# The hooks are registered when the model first meets the optimizer: its first step
# (``get_optimizer_state_dict`` and ``set_optimizer_state_dict`` step a fresh optimizer
# once to make its state, ``_init_optim_state`` in
# ``torch/distributed/checkpoint/state_dict.py``), ``zs.save`` or ``zs.load``. Until then
# its state dict holds no state of the shards, or what a load put there, which the first
# step turns into rows.
# ----------------------------------------------------------------------------------------

_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> stepper ids


def attach(stepper, optimizer) -> None:
    """Register the state-dict hooks of ``stepper``'s model on ``optimizer`` (once; none
    for no optimizer)."""
    if optimizer is None:
        return
    seen = _ATTACHED.setdefault(optimizer, set())
    if id(stepper) in seen:
        return
    seen.add(id(stepper))
    owner = weakref.ref(stepper)  # an optimizer kept past its model keeps nothing alive
    optimizer.register_state_dict_post_hook(lambda o, sd: _save(owner(), o, sd))
    optimizer.register_load_state_dict_pre_hook(lambda o, sd: _load(owner(), o, sd))
    # state loaded before the hooks were there (a load_state_dict before the first step)
    # may hold DTensors or full tensors: this rank's rows from now on
    by_shard = _by_shard(stepper)
    for p in _params(optimizer.param_groups):
        if id(p) in by_shard and p in optimizer.state:
            u, i = by_shard[id(p)]
            state = optimizer.state[p]
            for name, v in list(state.items()):
                t = _trailing(optimizer, u, i, name, v, p)
                rows = tuple(p.shape) if t in (None, False) else (p.shape[0], *t)
                if isinstance(v, DTensor) or (torch.is_tensor(v) and v.dim() > 0
                                              and t is not False and tuple(v.shape) != rows):
                    state[name] = _rows(u, i, v, f"optimizer state {name!r}", t)


def _by_shard(stepper) -> dict[int, tuple]:
    return {id(s): (u, i) for u in stepper.units for i, s in enumerate(u.shards)}


def _params(groups) -> list:
    """Parameters in the order torch numbers them in a state dict."""
    return [p for g in groups for p in g["params"]]


def _save(stepper, optimizer, state_dict: dict):
    if stepper is None:
        return None
    params, by_shard = _params(optimizer.param_groups), _by_shard(stepper)
    state = {}
    for key, values in state_dict["state"].items():
        p = params[key] if isinstance(key, int) and 0 <= key < len(params) else None
        if id(p) not in by_shard:
            state[key] = values
            continue
        u, i = by_shard[id(p)]
        # a new dict: torch's state_dict() hands out the optimizer's own per-parameter dicts
        state[key] = {name: _as_dtensor(optimizer, u, i, name, v, p)
                      for name, v in values.items()}
    return {**state_dict, "state": state}


def _as_dtensor(optimizer, unit, i: int, name: str, value, p):
    """A state of shard ``p`` in torch's terms: a per-element state (Adam's moments, Muon's
    momentum) as a DTensor of the parameter's layout; a state with one entry per row and
    another trailing shape (Adafactor's row statistics) as a DTensor of ``(d0, ...)``;
    a state the same on every rank (Adafactor's column statistic of a matrix,
    ``spec.optimizers.whole_state``) and scalars as they are, plain tensors being what
    DCP takes for replicated."""
    if not torch.is_tensor(value) or isinstance(value, DTensor) or value.dim() == 0:
        return value
    full = unit.params[i].shape
    if whole_state(type(optimizer).__name__, name, len(full)):
        return value  # first: a shard of one row has the column statistic's shape
    if value.shape == p.shape:
        return to_dtensor(unit, i, value)
    if not p.dim() or value.shape[0] != p.shape[0]:
        return value
    return to_dtensor(unit, i, value, trailing=tuple(value.shape[1:]))


def _load(stepper, optimizer, state_dict: dict):
    if stepper is None:
        return None
    by_shard = _by_shard(stepper)
    mine = dict(zip(_params(state_dict["param_groups"]), _params(optimizer.param_groups)))
    state = {}
    for key, values in state_dict["state"].items():
        p = mine.get(key)
        if id(p) not in by_shard:
            state[key] = values
            continue
        u, i = by_shard[id(p)]
        state[key] = {name: _rows(u, i, v, f"optimizer state {name!r} of {key!r}",
                                  _trailing(optimizer, u, i, name, v, p))
                      for name, v in values.items()}
    return {**state_dict, "state": state}


def _trailing(optimizer, unit, i: int, name: str, value, p) -> tuple | None | bool:
    """How a loaded state maps to rows: None for a per-element state, the trailing shape
    of a state with one entry per row, False for a whole state (kept as it is)."""
    full = tuple(unit.params[i].shape)
    if not torch.is_tensor(value) or value.dim() == 0:
        return None
    if whole_state(type(optimizer).__name__, name, len(full)):
        return False
    shape = tuple(value.shape)
    if shape in (full, tuple(p.shape)) or len(full) == 0:
        return None
    if shape[1:] != full[1:] and shape[0] in (full[0], p.shape[0]):
        return shape[1:]
    return None


def _rows(unit, i: int, value, what: str, trailing=None):
    """A per-element state (or one with an entry per row) as this rank's rows; a whole
    state and scalars as they are."""
    if not torch.is_tensor(value) or value.dim() == 0 or trailing is False:
        return value.full_tensor() if isinstance(value, DTensor) else value
    rows = local_rows(unit, i, value, what, trailing)
    if rows.untyped_storage().nbytes() > rows.numel() * rows.element_size():
        rows = rows.clone()  # rows of a full tensor: keep those alone
    return rows
