"""A unit's storages, made once from the model's parameters at ``zs.shard`` time.

Parameter by parameter, so a rank holds the unit once plus one parameter: each is copied
into a padded storage of N·c rows (``layout.py``), this rank's rows of it are copied
into the fp32 master where there is one, and the original goes. A tensor-parallel
parameter is its local slice here ([Note: tensor-parallel parameters] in ``local.py``). The
:class:`~zeroshard.runtime.unit.unit.Unit` keeps what this returns; nothing else
writes these fields.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from .layout import ShardLayout
from .local import local, repoint


class Storages(NamedTuple):
    padded: list[torch.Tensor]
    """Each parameter's full storage, ``[world, c·row]``; the parameter is a view of it."""
    master: torch.Tensor | None
    """1D ``[S_g]``: this rank's slot of fp32 master weights (None without a master)."""
    w_shard: torch.Tensor | None
    """1D ``[S_w]``: this rank's slot of compute weights where parameters are sharded."""


def pinned() -> bool:
    """Host buffers are pinned where there is a device to copy to asynchronously."""
    return torch.cuda.is_available()


def make_storages(params: list[nn.Parameter], trainable: list[int], w_layout: ShardLayout,
                  g_layout: ShardLayout, rank: int, policy, compute_dtype, master_dtype,
                  device: torch.device, host: torch.device) -> Storages:
    """The padded full storages (each parameter re-pointed into its own), the master slot
    and, where the policy shards parameters, this rank's slot of compute weights."""
    world = w_layout.world
    padded = []
    master = None
    if master_dtype is not None:
        master = torch.zeros(g_layout.slot_numel, dtype=master_dtype,
                             device=host if policy.offloads_optimizer else device,
                             pin_memory=policy.where("optimizer") == "host" and pinned())
    g_slot = {i: g_layout.slots[j] for j, i in enumerate(trainable)}
    for i, (slot, p) in enumerate(zip(w_layout.slots, params)):
        src = local(p).detach().to(device).reshape(slot.rows, slot.row_numel)
        if (src.dtype == compute_dtype and src.is_contiguous()
                and src.storage_offset() == 0 and slot.chunk_rows * world == slot.rows
                and src.untyped_storage().nbytes() == slot.numel * src.element_size()
                and src.untyped_storage().resizable()):
            # no padding: keep the storage, under a tensor with its own version counter
            # (autograd must not see the optimizer's in-place updates as edits of p).
            # Not one that cannot be resized (weights memory-mapped from a file, as
            # transformers' from_pretrained leaves them): release() empties it.
            buf = torch.empty(0, dtype=src.dtype, device=device).set_(
                src.untyped_storage(), 0, (world, slot.chunk_numel))
        else:
            buf = w_layout.padded_empty(slot, compute_dtype, device)
            buf.view(-1)[:slot.numel].copy_(src.reshape(-1))
            buf.view(-1)[slot.numel:].zero_()
        flat = buf.view(-1)
        if master is not None and i in g_slot:
            gs, real = g_slot[i], g_slot[i].real_rows(rank)
            first = rank * gs.chunk_rows
            master[gs.offset:gs.offset + real * gs.row_numel].copy_(
                src[first:first + real].reshape(-1))
        repoint(p, flat[:slot.numel].view(slot.shape))
        padded.append(buf)
        del src
    w_shard = None
    if policy.shards_params:
        w_shard = torch.cat([buf[rank] for buf in padded])
        if policy.where("params") == "host":  # copied to the device by each gather
            w_shard = w_shard.to(host)
            if pinned():
                w_shard = w_shard.pin_memory()
    return Storages(padded, master, w_shard)


def optimizer_views(params: list[nn.Parameter], trainable: list[int], w_layout: ShardLayout,
                    g_layout: ShardLayout, rank: int, st: Storages) -> list[nn.Parameter]:
    """The parameters the optimizer sees: views of this rank's rows, shaped
    ``[real_rows, *shape[1:]]``, of the master (mixed precision) or of the compute
    weights themselves (fp32: the weights are the master)."""
    if st.w_shard is not None:
        views = w_layout.shard_views(st.w_shard, rank)
    else:
        views = [buf[rank][:s.real_rows(rank) * s.row_numel].view(s.shard_shape(rank))
                 for buf, s in zip(st.padded, w_layout.slots)]
    if st.master is not None:
        for j, view in enumerate(g_layout.shard_views(st.master, rank)):
            views[trainable[j]] = view
    return [nn.Parameter(v, requires_grad=p.requires_grad) for v, p in zip(views, params)]
