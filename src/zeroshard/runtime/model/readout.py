"""What a sharded model gives out: its weights (the standard ``state_dict()`` /
``load_state_dict()``, full weights, ``gathered()``) and the bytes it holds and sends.

[Note: state dict] ``state_dict()`` returns what this rank holds, without a collective:
under each original name (tied names each, as torch does) the tensor the rank reads
and writes that parameter through (``unit/readout.held_rows``) — the fp32 master rows where
there is a master, else the weights — and the module's persistent buffers. At stages
1-3 a trainable parameter of d0 rows is rank r's dim-0 chunk, rows ``[r·c, r·c + c)``
with c = ceil(d0 / N) (``zeroshard.runtime.unit.layout.dim0_chunk``); at stage 0, and for a
frozen parameter below stage 3, the whole parameter. So ``torch.save`` of it on every
rank is a sharded checkpoint of the weights (FSDP2 returns sharded DTensors alike), and
nothing is gathered; ``full_state_dict()`` gathers the full weights, and
``zeroshard.save`` writes a resharding checkpoint with the optimizer state.

``load_state_dict()`` takes, per parameter, either this rank's rows (what
``state_dict()`` returned) or the full parameter (an unsharded model's state dict), checks
every shape before it writes anything, writes the master (or weights) and then brings
the compute weights up to date from it — a collective at stages 1-2, like the step.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch.nn.modules.module import _IncompatibleKeys

from ..build.construct import broadcast_buffers
from ..unit.readout import disk_bytes, full_tensors, held_rows, host_bytes, measure


def _by_param(model) -> dict[int, tuple]:
    return {id(p): (u, i) for u in model.units for i, p in enumerate(u.params)}


def state_dict_of(model, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
    """This rank's rows of every parameter and the persistent buffers (see the note)."""
    out = OrderedDict() if destination is None else destination
    owners = _by_param(model)
    for key, t in model.module.state_dict(keep_vars=True).items():
        if id(t) in owners:
            u, i = owners[id(t)]
            t = held_rows(u, i)[0]
        out[prefix + key] = t if keep_vars else t.detach()
    return out


def load_into(model, values: dict, strict: bool = True) -> _IncompatibleKeys:
    """Write ``values`` (this rank's rows or full tensors, per key) into the shards."""
    expected = model.module.state_dict(keep_vars=True)
    missing = [k for k in expected if k not in values]
    unexpected = [k for k in values if k not in expected]
    if strict and (missing or unexpected):
        raise ValueError(f"load_state_dict: missing keys {missing}, unexpected keys "
                         f"{unexpected}; the keys are the module's own names (as "
                         "state_dict() returns them); strict=False loads the rest")
    owners = _by_param(model)
    writes = []
    for key, t in expected.items():
        if key not in values:
            continue
        value = torch.as_tensor(values[key])
        if id(t) not in owners:  # a buffer
            if value.shape != t.shape:
                raise ValueError(f"load_state_dict: buffer {key!r} has shape "
                                 f"{tuple(value.shape)}, the model's {tuple(t.shape)}")
            writes.append((t, value))
            continue
        u, i = owners[id(t)]
        target, first = held_rows(u, i)
        full = tuple(u.params[i].shape)
        if tuple(value.shape) == full:  # the full parameter: this rank's rows of it
            count = target.shape[0] if target.dim() else 1
            rows = value.reshape(full[0] if full else 1, -1)[first:first + count]
            writes.append((target, rows.reshape(target.shape)))
        elif value.shape == target.shape:
            writes.append((target, value))
        else:
            raise ValueError(
                f"load_state_dict: {key!r} has shape {tuple(value.shape)}; expected the full "
                f"parameter {full} or this rank's rows {tuple(target.shape)} (from row {first})")
    with torch.no_grad():
        for target, value in writes:
            target.copy_(value)
    model.refresh_compute()
    return _IncompatibleKeys(missing, unexpected)


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Full, unsharded weights (the fp32 master where there is one) and buffers under
    their original names. A collective: every rank must call it. With
    ``broadcast_buffers`` the buffers are rank 0's (broadcast first, as the next
    forward would), so every rank returns the same state."""
    model.synchronize()
    if model.zero_config.broadcast_buffers:
        broadcast_buffers(model.module, model.comm)
    values = {}
    for u in model.units:
        values.update(full_tensors(u))
    by_id = {id(p): values[n] for u in model.units for n, p in zip(u.names, u.params)}
    out = {}
    for key, t in model.module.state_dict(keep_vars=True).items():
        out[key] = by_id[id(t)] if id(t) in by_id else t.detach().clone()
    return out

def memory(model, optimizer=None, by_placement: bool = False) -> dict:
    """Bytes on this rank per category: params, grads, optimizer (master + state of
    ``optimizer``), padding, and the transient gathered and buffers. With
    ``by_placement``, ``{"device": {...}, "host": {...}, "disk": {...}}``: what
    offload keeps in host memory apart (``ZeroConfig.offload``), and what disk
    offload keeps in files (``ZeroConfig.offload_dir``; the host then holds the
    step's sub-group buffers)."""
    total = measure(model.units, optimizer)
    streamed = model.stepper.disk_step.buffer_bytes() if model.stepper.disk_step is not None else 0
    total["buffers"] += streamed  # disk offload's sub-group buffers, on the host
    if not by_placement:
        return total
    host, disk = dict.fromkeys(total, 0), dict.fromkeys(total, 0)
    host["buffers"] += streamed
    for u in model.units:
        for c, b in host_bytes(u, optimizer).items():
            host[c] += b
        for c, b in disk_bytes(u).items():
            disk[c] += b
    return {"device": {c: total[c] - host[c] - disk[c] for c in total}, "host": host,
            "disk": disk}

