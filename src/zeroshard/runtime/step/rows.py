"""What the engine's own optimizer steps (``reduced.py``, ``matrix.py``) read off the
model: each shard an optimizer holds with the full parameter's shape and the first full
row this rank holds, and the one all-reduce that completes sums over rows."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..unit.layout import dim0_chunk


class Rows(NamedTuple):
    """One parameter of an optimizer, as this rank holds it."""

    shard: torch.Tensor
    """The optimizer's tensor: this rank's rows, ``[rows, *shape[1:]]``."""
    shape: tuple[int, ...]
    """The full parameter's shape."""
    first: int
    """The first full row the shard holds."""
    group: dict
    """The optimizer's param group it is in (its hyper-parameters, read at each step)."""

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        n = 1
        for d in self.shape:
            n *= d
        return n


def rows_of(optimizer, units) -> list[Rows]:
    """The shards of ``units`` that ``optimizer`` steps, in its param groups' order."""
    table = {id(u.shards[i]): (u, i) for u in units for i in u.trainable}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            hit = table.get(id(p))
            if hit is None:  # frozen, or another model's
                continue
            u, i = hit
            shape = tuple(u.params[i].shape)
            first = dim0_chunk(shape[0] if shape else 1, u.rank, u.world)[0]
            out.append(Rows(p, shape, first, group))
    return out


def with_grads(rows: list[Rows]) -> list[Rows]:
    """The parameters that have a gradient this step: the same on every rank (a shard
    gets one where any rank saw its parameter, ``unit.assign_step_grads``), so every rank
    issues the same collectives."""
    return [r for r in rows if r.shard.grad is not None]


def drop_grads(rows: list[Rows]) -> None:
    """The engine has stepped these: the optimizer's own ``step()`` finds no gradient."""
    for r in rows:
        r.shard.grad = None


def sum_over_ranks(comm, parts: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Each of ``parts`` (partial sums over this rank's rows) added up over the shard
    group: one all-reduce of their fp64 concatenation, whatever their number. fp64 so
    that the sums' order across ranks changes nothing an fp32 update can see."""
    if not parts:
        return []
    flat = torch.cat([p.detach().reshape(-1).to(torch.float64) for p in parts]).to(device)
    comm.all_reduce(flat)
    flat = flat.to(parts[0].device)
    out, at = [], 0
    for p in parts:
        out.append(flat[at:at + p.numel()].view(p.shape))
        at += p.numel()
    return out
