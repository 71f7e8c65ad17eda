"""Gradient clipping by the global norm when every rank holds a slice of it.

Each rank sums ``|g|^p`` over the rows it owns and one all-reduce adds the partial
sums (the source documents' "all-reduce of local sums of squares"), so every rank
applies the same factor; a per-rank norm would scale each slice differently.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def clip_grad_norm(units, comm, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip by the global norm over all ranks' shards (padding never counts); return
    the norm. Each rank sums ``|g|^p`` over the rows it owns — where its shard is whole
    (stage 0) over the rows it *would* own at N ranks (``Unit.norm_grads``) — and one
    all-reduce adds them, so every stage computes the same norm bit for bit."""
    norm_type = float(norm_type)
    parts = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float64)
             for u in units for g in u.norm_grads()]
    grads = [u.shards[i].grad for u in units for i in u.trainable
             if u.shards[i].grad is not None]
    local = (torch.stack(parts) if parts else
             torch.zeros(1, dtype=torch.float64, device=units[0].device))
    if norm_type == float("inf"):
        total = local.max()
        comm.all_reduce(total, op=dist.ReduceOp.MAX)
    else:
        total = local.pow(norm_type).sum()
        comm.all_reduce(total)
        total = total.pow(1.0 / norm_type)
    total = total.to(torch.float32)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef)
    return total
