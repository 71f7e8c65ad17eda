"""Issuing gradient reductions: a bucket of units, one collective.

The engine (``sharded.py``) decides *when* a unit's reduction is issued (in a fixed
order, every rank the same); this module packs the units' local gradients into one
communication buffer and starts the collective the policy names over it.
Each unit lands its share later in :meth:`Unit.wait_reduce`.
"""

from __future__ import annotations

import torch

from ..unit.readout import local_grads
from ..unit.unit import Unit


def issue_reduce(units: list[Unit]) -> None:
    """Pack the local gradients of ``units`` — plus one presence flag per parameter, so a
    parameter that no rank saw gets no update — into one buffer and start one all-reduce
    (full gradients averaged, stage 0) or reduce-scatter over it. One unit is the usual bucket; with
    ``reduce_bucket_size`` consecutive units share one collective.

    Rank r's slot of the buffer is [unit 1's slot r | its flags | unit 2's slot r | ...],
    so each unit's share of the result is one contiguous range of it."""
    for u in units:
        u.wait_reduce()  # the previous micro-batch's reduction lands first
    units = [u for u in units if u.trainable]
    if not units:
        return
    first = units[0]  # the units of a model share one policy and one recipe
    n, comm = first.comm.mesh.shard_world, first.comm  # slots: the shard group's ranks
    tensors, spans, base = [], [], 0
    for u in units:
        grads, flags = local_grads(u)
        tensors += grads + [flags.expand(n, len(u.trainable))]
        width = u.r_layout.slot_numel + len(u.trainable)
        spans.append((base, base + width))
        base += width
    buf = torch.empty(n * base, dtype=first.reduce_dtype, device=first.device)
    torch._chunk_cat(tensors, 0, n, out=buf.view(n, base))
    label = [u.index for u in units] if len(units) > 1 else first.index
    if first.policy.reduce == "all_reduce":
        work = comm.all_reduce(buf, grads=True, async_op=True, unit=label)
        out = buf.view(n, base)
        parts = [out[:, a:b] for a, b in spans]  # [N, S + F] each
    else:
        out = torch.empty(base, dtype=first.reduce_dtype, device=first.device)
        work = comm.reduce_scatter(out, buf, mean=True, async_op=True, unit=label)
        parts = [out[a:b] for a, b in spans]
    for u, part in zip(units, parts):
        u.reduction_issued(work, buf, part)
