"""What the rest of the engine reads off a unit, without changing it: the bytes it
holds by ledger category (:func:`memory`, :func:`host_bytes`, :func:`disk_bytes`,
:func:`buffers_in_flight`; :func:`measure` for a list of units), the rows this rank
holds of each parameter (:func:`held_rows`, for state dicts and checkpoints), the
gradient rows it counts in a global norm (:func:`norm_grads`, for clipping and the
non-finite check), its local gradients packed for a reduction (:func:`local_grads`)
and the full values (:func:`full_tensors`). The model's readout,
clipping, checkpoints and the profiler read a unit through these alone."""

from __future__ import annotations

from collections import Counter

import torch

from ...spec.policy import FullGrads
from ..ledger import CATEGORIES, optimizer_state_bytes, tensor_bytes
from .layout import dim0_chunk
from .local import local, local_grad, tp_dim
from .state import UnitState


def held_rows(unit, i: int) -> tuple[torch.Tensor, int]:
    """The tensor this rank reads and writes parameter ``i``'s values through, and the
    first full row it holds: the optimizer-facing shard (rows of the dim-0 chunk
    ``dim0_chunk(rows, rank, world)``), or, for a frozen parameter kept whole, the
    compute weight itself from row 0. Rows of the local slice of a tensor-parallel
    parameter ([Note: tensor-parallel parameters] in ``local.py``)."""
    p = local(unit.params[i])
    if i in unit.trainable or unit.w_shard is not None:
        rows = p.shape[0] if p.dim() else 1
        return unit.shards[i], dim0_chunk(rows, unit.rank, unit.world)[0]
    return p, 0


def norm_grads(unit) -> list[torch.Tensor]:
    """The part of each shard's gradient this rank counts in a global norm: its own
    rows, or where the shard is whole (stage 0) the rows it would own in its shard
    group, so every stage sums the same partial norms (summed over the shard group:
    the replica groups hold the same rows). Beside tensor parallelism, summed over the
    tp group too: a parameter every tp rank holds whole (a norm, a row-parallel bias)
    counts on tp rank 0 only."""
    out = []
    mesh = unit.comm.mesh
    for j, i in enumerate(unit.trainable):
        g = unit.shards[i].grad
        if g is None or (mesh.tp_rank and tp_dim(unit.params[i]) is None):
            continue
        if unit.world == 1 and unit.comm.mesh.shard_world > 1:
            rows = unit.g_layout.slots[j].rows
            a, b = dim0_chunk(rows, unit.comm.mesh.shard_rank, unit.comm.mesh.shard_world)
            g = g.reshape(rows, -1)[a:b]
        out.append(g)
    return out


def local_grads(unit) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Full local gradients as [rows, row] views (zeros where none) and [F] flags."""
    grads, flags = [], []
    for j, i in enumerate(unit.trainable):
        g, slot = local_grad(unit.params[i]), unit.g_layout.slots[j]
        flags.append(g is not None)
        grads.append(torch.zeros(slot.rows, slot.row_numel, dtype=unit.grad_dtype,
                                 device=unit.device) if g is None
                     else g.reshape(slot.rows, slot.row_numel))
    return grads, torch.tensor(flags, dtype=unit.grad_dtype, device=unit.device)


def memory(unit, optimizer=None) -> dict[str, int]:
    """Bytes this unit holds on this rank by ledger category (``runtime/ledger.py``),
    read off the tensors themselves; communication buffers in flight are
    :func:`buffers_in_flight` (the units of a reduce bucket share one)."""
    pol, r, out = unit.policy, unit.rank, dict.fromkeys(CATEGORIES, 0)
    w_item = unit.compute_dtype.itemsize
    if pol.shards_params:  # the slot between uses; the full weights while gathered
        out["params"] += unit.w_layout.real_numel(r) * w_item
        out["padding"] += (unit.w_layout.slot_numel - unit.w_layout.real_numel(r)) * w_item
        if unit.state is UnitState.GATHERED:
            out["gathered"] += sum(tensor_bytes(b) for b in unit.padded)
        if unit.w_secondary is not None:  # hpZ: kept from forward for backward
            out["gathered"] += tensor_bytes(unit.w_secondary)
    else:  # full, in padded storages
        out["params"] += unit.w_layout.numel * w_item
        out["padding"] += sum(tensor_bytes(b) for b in unit.padded) - out["params"]
    g_real, g_slot = unit.g_layout.real_numel(r), unit.g_layout.slot_numel
    if pol.keeps_full_grads:
        averaged = pol.full_grads is FullGrads.AVERAGED
        for i in unit.trainable:
            g = local(unit.params[i].grad)
            if g is None and averaged and unit.master is None:
                g = unit.shards[i].grad  # after the step: a view of them, until zero_grad()
            if g is not None:
                out["grads"] += tensor_bytes(g)
                if averaged:  # landed in a padded [N, c·row] storage: the rest is padding
                    out["padding"] += g.untyped_storage().nbytes() - tensor_bytes(g)
        if unit.grad_shard is not None:  # stage 1's reduced slot, until the step
            out["buffers"] += tensor_bytes(unit.grad_shard)
    elif unit.grad_shard is not None:  # between a cycle's first reduction and its step
        out["grads"] += g_real * unit.grad_dtype.itemsize
        out["padding"] += (g_slot - g_real) * unit.grad_dtype.itemsize
    if unit.disk is not None:  # the file: master and both moments, padding included
        for c, b in disk_bytes(unit).items():
            out[c] += b
    elif unit.master is not None:
        out["optimizer"] += g_real * unit.master_dtype.itemsize
        out["padding"] += (g_slot - g_real) * unit.master_dtype.itemsize
        if not pol.shards_optimizer:  # fp32 copies of the full gradients for the step
            out["buffers"] += sum(tensor_bytes(unit.shards[i].grad) for i in unit.trainable
                                  if unit.shards[i].grad is not None)
    if unit.disk is None:
        out["optimizer"] += optimizer_state_bytes(optimizer, unit.shards)
    if unit.step_grads is not None and unit.step_grads is not unit.grad_shard:
        out["buffers"] += tensor_bytes(unit.step_grads)
    if unit.host_grads is not None and unit.host_grads is not unit.step_grads:
        out["buffers"] += tensor_bytes(unit.host_grads)  # offload: landed, not yet handed
    return out


def host_bytes(unit, optimizer=None) -> dict[str, int]:
    """The part of :func:`memory` that lives on the host (offload): the master, its
    padding and the optimizer state (in :func:`disk_bytes` instead with
    ``offload_dir``), the step's fp32 gradients, and with ``offload="params"`` the
    weight shard and its padding."""
    out = dict.fromkeys(CATEGORIES, 0)
    pol, r = unit.policy, unit.rank
    if pol.offloads_optimizer and unit.master is not None:
        g_real, g_slot = unit.g_layout.real_numel(r), unit.g_layout.slot_numel
        if unit.disk is None:
            out["optimizer"] += (g_real * unit.master_dtype.itemsize
                                 + optimizer_state_bytes(optimizer, unit.shards))
            out["padding"] += (g_slot - g_real) * unit.master_dtype.itemsize
        if unit.step_grads is not None and unit.step_grads is not unit.grad_shard:
            out["buffers"] += tensor_bytes(unit.step_grads)
        if unit.host_grads is not None and unit.host_grads is not unit.step_grads:
            out["buffers"] += tensor_bytes(unit.host_grads)
    if pol.shards_params and pol.where("params") == "host":
        w_item, w_real = unit.compute_dtype.itemsize, unit.w_layout.real_numel(r)
        out["params"] += w_real * w_item
        out["padding"] += (unit.w_layout.slot_numel - w_real) * w_item
    return out


def disk_bytes(unit) -> dict[str, int]:
    """The part of :func:`memory` in files (disk offload): the master and Adam's two
    moments, three fp32 planes of the slot, its padding included."""
    out = dict.fromkeys(CATEGORIES, 0)
    if unit.disk is not None:
        g_real = unit.g_layout.real_numel(unit.rank)
        out["optimizer"] = 3 * 4 * g_real
        out["padding"] = 3 * 4 * (unit.disk.numel - g_real)
    return out


def buffers_in_flight(unit) -> list[torch.Tensor]:
    """Communication buffers of this unit's collectives not yet landed."""
    return unit.ctx.buffers(unit.index)


def full_tensors(unit) -> dict[str, torch.Tensor]:
    """Full values under original names: the master where there is one (the source
    of truth), else the compute weights. A collective over the shard group. A
    tensor-parallel parameter's value is its local slice, whole over the shard group."""
    values = {}
    whole = unit.w_shard is None
    for i, p in enumerate(unit.params):
        if whole and (unit.master is None or i not in unit.trainable):
            values[unit.names[i]] = local(p).detach().clone()
    masters = [i for i in unit.trainable] if unit.master is not None else []
    if masters and unit.world == 1:
        for i in masters:
            values[unit.names[i]] = unit.shards[i].detach().clone().view(
                unit.w_layout.slots[i].shape)
    elif masters:
        out = torch.empty(unit.world * unit.g_layout.slot_numel, dtype=unit.master_dtype,
                          device=unit.device)
        unit.comm.all_gather(out, unit.master)
        for i, t in zip(masters, unit.g_layout.unpack(out)):
            values[unit.names[i]] = t
    if not whole:
        rest = [i for i in range(len(unit.params)) if unit.names[i] not in values]
        out = torch.empty(unit.world * unit.w_layout.slot_numel, dtype=unit.compute_dtype,
                          device=unit.device)
        unit.comm.all_gather(out, unit.w_shard)
        full = unit.w_layout.unpack(out)
        for i in rest:
            values[unit.names[i]] = full[i]
    return values


def measure(units, optimizer=None) -> dict[str, int]:
    """``{category: bytes}`` held on this rank by ``units``: each unit's own account
    (:func:`memory`), plus the communication buffers in flight, counted once
    where the units of a reduce bucket share one."""
    out: Counter[str] = Counter({c: 0 for c in CATEGORIES})
    in_flight: dict[int, object] = {}
    for u in units:
        out.update(memory(u, optimizer))
        for t in buffers_in_flight(u):
            base = t if t._base is None else t._base
            in_flight[id(base)] = base
    out["buffers"] += sum(tensor_bytes(t) for t in in_flight.values())
    return dict(out)
