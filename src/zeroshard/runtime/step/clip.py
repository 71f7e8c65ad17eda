"""Gradient clipping by the global norm when every rank holds a slice of it.

Each rank sums ``|g|^p`` over the rows it owns and one all-reduce adds the partial
sums (the source documents' "all-reduce of local sums of squares"), so every rank
applies the same factor; a per-rank norm would scale each slice differently. Beside
tensor parallelism a second all-reduce adds the tp ranks' sums, a parameter every tp
rank holds whole counted on one of them (``unit/readout.norm_grads``): torch's own
``clip_grad_norm_`` refuses FSDP2 + TP's parameters, which sit on two meshes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..unit.readout import norm_grads


def check_clip_args(max_norm, norm_type) -> None:
    """A ValueError naming a ``max_norm`` or ``norm_type`` that cannot be clipped by."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not (
            0 <= max_norm < float("inf")):
        raise ValueError(f"max_norm={max_norm!r}; expected a finite number >= 0")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not (
            norm_type > 0):
        raise ValueError(f"norm_type={norm_type!r}; expected a number > 0 or float('inf')")


@torch.no_grad()
def clip_grad_norm(units, comm, max_norm: float, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip by the global norm over all ranks' shards (padding never counts); return
    the norm. Each rank sums ``|g|^p`` over the rows it owns — where its shard is whole
    (stage 0) over the rows it *would* own at N ranks (``unit/readout.norm_grads``) — and one
    all-reduce adds them, so every stage computes the same norm bit for bit."""
    norm_type = float(norm_type)
    parts = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float64)
             for u in units for g in norm_grads(u)]
    grads = [u.shards[i].grad for u in units for i in u.trainable
             if u.shards[i].grad is not None]
    local = (torch.stack(parts).to(units[0].device) if parts else  # (offload: from the host)
             torch.zeros(1, dtype=torch.float64, device=units[0].device))
    tp = comm.mesh.tp_world > 1  # then the tp ranks' slices too, a replicated one once
    if norm_type == float("inf"):
        total = local.max()
        comm.all_reduce(total, op=dist.ReduceOp.MAX)
        if tp:
            comm.all_reduce(total, op=dist.ReduceOp.MAX, tp=True)
    else:
        total = local.pow(norm_type).sum()
        comm.all_reduce(total)
        if tp:
            comm.all_reduce(total, tp=True)
        total = total.pow(1.0 / norm_type)
    total = total.to(torch.float32)
    if error_if_nonfinite and not torch.isfinite(total):  # the same total on every rank
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                           f"non-finite ({total.item()}), so they cannot be clipped")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total


_TORCH_CLIP: list = []  # torch's own clip_grad_norm_, once redirected


def redirect_torch_clip(live_models) -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` correct on a sharded model's parameters.

    Given the shards, torch's function would sum this rank's rows only and each rank
    would clip by its own partial norm — silently unlike torch DDP. Once a sharded
    model exists, the function is replaced by one that hands a sharded model's
    parameters to ``model.clip_grad_norm_`` (the global norm) and any other parameters
    to torch's own. (A reference bound with ``from torch.nn.utils import
    clip_grad_norm_`` before the first ``zs.shard`` keeps torch's: call it through
    ``torch.nn.utils`` or ``model.clip_grad_norm_``.)"""
    if _TORCH_CLIP:
        return
    from torch.nn.utils import clip_grad

    _TORCH_CLIP.append(clip_grad.clip_grad_norm_)

    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                        foreach=None):
        params = [parameters] if torch.is_tensor(parameters) else list(parameters)
        ids = {id(p) for p in params}
        owners = [m for m in list(live_models) if m.holds_any(ids)]
        if not owners:
            return _TORCH_CLIP[0](params, max_norm, norm_type, error_if_nonfinite, foreach)
        if len(owners) > 1 or not owners[0].covers_trainable(ids):
            raise ValueError(
                "torch.nn.utils.clip_grad_norm_ got part of a sharded model's trainable "
                "parameters (or parameters of several models): the norm is global over all "
                "of one model's shards; pass model.parameters(), or call "
                "model.clip_grad_norm_()")
        return owners[0].clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    clip_grad_norm_.__doc__ = _TORCH_CLIP[0].__doc__
    clip_grad.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
