"""A sharded model's state dict in torch's terms: DTensors.

[Note: state dict] ``state_dict()`` returns, without a collective, under each of the
module's own names (tied names each, as torch does), what this rank holds of that
parameter as a DTensor of the full shape on the shard group's device mesh
(``unit/dtensor.py``, [Note: DTensor layout]): the fp32 master rows where there is a
master, else the weights; ``Shard(0)`` where sharded, ``Replicate()`` where whole; and
the module's persistent buffers as plain tensors (replicated, as DDP keeps them). The
DTensors share memory with what the model holds, as FSDP2's do, so
``torch.distributed.checkpoint`` loads in place; FSDP2 returns the same layout, which is
why DCP can save one and load the other, reshard across world sizes and stages, and why
``get_model_state_dict`` / ``set_model_state_dict`` work on a sharded model.

``torch.save(model.state_dict())`` on every rank is a sharded checkpoint of the weights
(each rank's file holds its rows). ``full_state_dict()`` gathers full weights;
``zeroshard.save`` writes a resharding checkpoint with the optimizer state.

``load_state_dict()`` takes, per parameter, a DTensor (any mesh and placements: its
local tensor where laid out as ours, else gathered whole), the full tensor (an unsharded
model's state dict) or this rank's rows, checks every shape before it writes anything,
writes the master (or weights) and then brings the compute weights up to date from it —
a collective at stages 1-2, like the step. The same values then load through the
module itself (``guard.py``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from ..unit.dtensor import held, local_rows, to_dtensor


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
