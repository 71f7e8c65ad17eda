"""Every collective the engine issues goes through :class:`Collectives`, which records
it in the ledger. Gradients and parameters travel on separate process groups so that
a rank whose reductions start late (an unused parameter) cannot pair its reduce with
another rank's gather: each group sees its collectives in the same order on every rank.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..observe.ledger import Ledger

# torch 2.13 renamed these; the old names warn. Older releases only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Collectives:
    """The data-parallel group: ``dp_rank``, ``dp_world`` and recorded collectives."""

    def __init__(self, ledger: Ledger, group=None):
        self.ledger = ledger
        self.group = group
        self.dp_rank = dist.get_rank(group)
        self.dp_world = dist.get_world_size(group)
        # One more group with the same ranks, for gradient reductions only.
        self.reduce_group = dist.new_group(dist.get_process_group_ranks(group)
                                           if group is not None else None)
        self.trace: list[dict] | None = None  # profiling: one record per call

    def _issue(self, kind: str, t: torch.Tensor, unit, call, async_op: bool):
        """Record the call in the ledger and, when profiling, in the collective trace."""
        nbytes = t.numel() * t.element_size()
        self.ledger.record(kind, nbytes, self.dp_world)
        if self.trace is None:
            return call()
        rec = {"kind": kind, "unit": unit, "bytes": nbytes, "issued": time.perf_counter()}
        self.trace.append(rec)
        work = call()
        if not async_op:
            rec["done"] = time.perf_counter()
            rec["waited"] = rec["done"] - rec["issued"]
            return work
        return _TracedWork(work, rec)

    def all_reduce(self, t: torch.Tensor, *, op=dist.ReduceOp.SUM, grads: bool = False,
                   async_op: bool = False, unit=None):
        """Reduce ``t`` over ranks in place (a sum unless ``op`` says otherwise)."""
        group = self.reduce_group if grads else self.group
        return self._issue("all_reduce", t, unit, lambda: dist.all_reduce(
            t, op=op, group=group, async_op=async_op), async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = False,
                       unit=None):
        """``out`` (1/N of ``inp``) receives the sum over ranks of this rank's slot."""
        return self._issue("reduce_scatter", inp, unit, lambda: _reduce_scatter(
            out.view(-1), inp.view(-1), group=self.reduce_group, async_op=async_op), async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = False,
                   unit=None):
        """``out`` (N × ``inp``) receives every rank's ``inp`` in rank order."""
        # gloo splits the output on dim 0 and wants each piece shaped like the input
        return self._issue("all_gather", out, unit, lambda: _all_gather(
            out.view(-1), inp.view(-1), group=self.group, async_op=async_op), async_op)

    def broadcast(self, t: torch.Tensor, src: int = 0):
        """Copy rank ``src``'s ``t`` to every rank."""
        root = dist.get_global_rank(self.group, src) if self.group is not None else src
        return self._issue("broadcast", t, None,
                           lambda: dist.broadcast(t, src=root, group=self.group), False)


class _TracedWork:
    """A work handle that notes when compute waited for it, and how long."""

    def __init__(self, work, rec):
        self.work, self.rec = work, rec

    def wait(self) -> None:
        start = time.perf_counter()
        self.work.wait()
        self.rec["done"] = time.perf_counter()
        self.rec["waited"] = self.rec.get("waited", 0.0) + self.rec["done"] - start
