"""Gradient arithmetic of a unit that needs none of its state: kept apart so that
``unit.py`` holds the unit's fields and the methods that change them."""

from __future__ import annotations

import torch

from .layout import ShardLayout


def averaged_grads(summed: torch.Tensor, present: list[bool], r_layout: ShardLayout,
                   n: int, dtype: torch.dtype) -> list[torch.Tensor | None]:
    """Averaged full gradients (stage 0) from the summed [K, S] buffer (K slots of the
    shard group, summed over all N ranks): each divided by ``n``, flat, or None where no
    rank saw the parameter (``present[j]`` false).

    Each gradient gets a padded storage [K, c·row] (the weights' layout), so its column
    range of the buffer lands in one pass that divides, casts to the stored dtype and
    copies at once (the same quotient, rounded once, as dividing the buffer first). The
    local gradients were freed when the reduction was issued, so these allocations
    replace them rather than add to them. A parameter no rank saw keeps no gradient: a
    zero one would count as seen in the next backward of the cycle and be stepped with
    weight decay (reading the flags is a host synchronisation the maths needs)."""
    out: list[torch.Tensor | None] = []
    k = summed.shape[0]
    for slot, seen in zip(r_layout.slots, present):
        if not seen:
            out.append(None)
            continue
        buf = torch.empty(k, slot.chunk_numel, dtype=dtype, device=summed.device)  # padded
        torch.div(summed[:, slot.offset:slot.offset + slot.chunk_numel], n, out=buf)
        out.append(buf.view(-1)[:slot.numel])
    return out
