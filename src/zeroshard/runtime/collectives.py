"""Every collective the engine issues goes through :class:`Collectives`, which records
it in the ledger. Gradients and parameters travel on separate process groups so that
a rank whose reductions start late (an unused parameter) cannot pair its reduce with
another rank's gather: each group sees its collectives in the same order on every rank.

[Note: gloo] On CPU tensors over gloo, reduce-scatter and all-gather are realised with
gloo's in-place collectives instead of torch's gloo reduce-scatter and all-gather, which
stage their data through extra full-size copies:

- gloo's reduce-scatter runs an all-reduce on a copy of its input. An all-reduce of the
  input in place, then this rank's slot copied out, sums every element in the same
  order (the same bits) without the copy; ``bench/gloo_collectives.py`` on 2 CPU cores,
  2-4 ranks, a 7 MB buffer: 0.70-0.85x the time, and no copy of the input in flight.
- gloo's all-gather gathers into a fresh flat buffer the size of the output and copies
  it out when done. N broadcasts in place, rank k's from rank k into slot k of the
  output, move the same bytes per rank and need no buffer: 0.66-0.80x the time, and one
  output-sized buffer less in flight (at stage 3 a prefetched unit held twice its size).
  Up to ``GLOO_BROADCAST_MAX`` ranks only, the range measured: each broadcast is a
  binomial tree of ⌈log2 N⌉ hops, and past a few ranks N of them, two at a time on
  gloo's worker threads, are not known to beat its all-gather.

The ledger records the collective the algorithm performs (ZeRO's accounting), so
measured and planned bytes stay the same quantity whatever the backend runs.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..plan.hardware import GLOO_BROADCAST_MAX
from . import watch
from .ledger import Ledger

# torch 2.13 renamed these; the old names warn. Older releases only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Collectives:
    """The data-parallel group: ``dp_rank``, ``dp_world`` and recorded collectives."""

    def __init__(self, ledger: Ledger, group=None, check: bool = True):
        self.ledger = ledger
        self.group = group
        self.dp_rank = dist.get_rank(group)
        self.dp_world = dist.get_world_size(group)
        self.global_ranks = (dist.get_process_group_ranks(group) if group is not None
                             else list(range(self.dp_world)))
        self.global_rank = dist.get_rank()
        self.group_name = dist.distributed_c10d._get_process_group_name(
            group if group is not None else dist.distributed_c10d._get_default_group())
        self.timeout_s = _timeout_s(group)
        # One more group with the same ranks, for gradient reductions only.
        self.reduce_group = _twin(group)
        backend = str(dist.get_backend(group))
        self._gloo = "gloo" in backend
        # Fingerprints and small agreements (``agree``) on a gloo group of their own
        # (host-side: no device synchronisation under NCCL, and never queued behind a
        # large collective); on the fake test backend, the parameter group.
        self.control_group = (_twin(group, backend="gloo") if backend in ("gloo", "nccl")
                              else group)
        self.check = check  # fingerprint every collective ([Note: fingerprints])
        # Where this rank is, for the fingerprints: the engine moves them on.
        self.seq, self.step, self.phase = 0, 0, "setting up"
        self.unit_names: list[str] = []
        self.trace: list[dict] | None = None  # profiling: one record per call

    def _issue(self, kind: str, t: torch.Tensor, unit, call, async_op: bool, value: int = 0):
        """Record the call in the ledger (and, when profiling, in the collective trace),
        issue its fingerprint, then ``call()``, which issues the collective itself
        asynchronously and returns its work handle (None: the fingerprint is all)."""
        nbytes = t.numel() * t.element_size()
        if call is not None:  # an agreement is its fingerprint: recorded below
            self.ledger.record(kind, nbytes, self.dp_world)
        self.seq += 1
        rec = None
        if self.trace is not None:
            rec = {"kind": kind, "unit": unit, "bytes": nbytes, "issued": time.perf_counter()}
            self.trace.append(rec)
        mine, rows, fp_work = watch.fingerprint(self, kind, unit, t.numel(), value), None, None
        if self.check or call is None:
            rows = torch.empty(self.dp_world, watch.WIDTH, dtype=torch.int64)
            self.ledger.record("check", rows.numel() * rows.element_size(), self.dp_world)
            fp_work = _all_gather(rows.view(-1), mine, group=self.control_group, async_op=True)
        ticket = _Ticket(self, call() if call is not None else None, mine, fp_work, rows, rec)
        if not async_op:
            ticket.wait()
            return None
        return ticket

    def all_reduce(self, t: torch.Tensor, *, op=dist.ReduceOp.SUM, grads: bool = False,
                   async_op: bool = False, unit=None):
        """Reduce ``t`` over ranks in place (a sum unless ``op`` says otherwise)."""
        group = self.reduce_group if grads else self.group
        return self._issue("all_reduce", t, unit, lambda: dist.all_reduce(
            t, op=op, group=group, async_op=True), async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, *, mean: bool = False,
                       async_op: bool = False, unit=None):
        """``out`` (1/N of ``inp``) receives the sum over ranks of this rank's slot, or
        with ``mean`` that sum divided by N (in the wait, the same bits as dividing after
        it). On gloo ``inp`` is summed in place (every slot: it holds the sums afterwards)
        and the slot lands in ``out`` divided and copied in one pass."""
        n = self.dp_world
        if self._on_gloo(inp):  # [Note: gloo]
            def call():
                work = dist.all_reduce(inp, group=self.reduce_group, async_op=True)
                slot, dst = inp.view(n, -1)[self.dp_rank], out.view(-1)
                return _Then(work, then=(lambda: torch.div(slot, n, out=dst)) if mean
                             else (lambda: dst.copy_(slot)))
        else:
            def call():
                work = _reduce_scatter(out.view(-1), inp.view(-1), group=self.reduce_group,
                                       async_op=True)
                return _Then(work, then=lambda: out.div_(n)) if mean else work
        return self._issue("reduce_scatter", inp, unit, call, async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = False,
                   unit=None):
        """``out`` (N × ``inp``) receives every rank's ``inp`` in rank order."""
        if self._on_gloo(out) and self.dp_world <= GLOO_BROADCAST_MAX:  # [Note: gloo]
            def call():
                slots = out.view(self.dp_world, -1)  # [N, numel(inp)]
                if slots[self.dp_rank].data_ptr() != inp.data_ptr():
                    slots[self.dp_rank].copy_(inp.view(-1))
                return _Then(*[dist.broadcast(slots[k], group_src=k, group=self.group,
                                              async_op=True) for k in range(self.dp_world)])
        else:
            def call():
                return _all_gather(out.view(-1), inp.view(-1), group=self.group,
                                   async_op=True)
        return self._issue("all_gather", out, unit, call, async_op)

    def agree(self, value: int):
        """Start gathering every rank's ``value`` (one small all-gather on the host, with
        its fingerprint); the returned function waits for it and returns them in rank
        order."""
        ticket = self._issue("check", torch.empty(0, dtype=torch.int64), None, None, True,
                             value=value)
        return lambda: (ticket.wait(), ticket.rows[:, -1].tolist())[1]

    def _on_gloo(self, t: torch.Tensor) -> bool:
        return self._gloo and t.device.type == "cpu" and self.dp_world > 1

    def broadcast(self, t: torch.Tensor, src: int = 0):
        """Copy rank ``src``'s ``t`` to every rank."""
        root = dist.get_global_rank(self.group, src) if self.group is not None else src
        return self._issue("broadcast", t, None, lambda: dist.broadcast(
            t, src=root, group=self.group, async_op=True), False)


def _twin(group, backend=None):
    """A new process group with the ranks of ``group``, created on every rank of the
    world (``zs.shard`` is a collective of the whole world). Ranks in other data-parallel
    groups (HSDP's replicas) pass other groups at the same moment, so the rank lists are
    exchanged first and every rank creates every twin, in one order: torch names a
    group by its creation order, so a group created by its members alone could get
    another name on each of them and never meet."""
    world = dist.get_world_size()
    timeout = _timeout_of(group)  # torch gives a new group 30 minutes, not its parent's
    if group is None or dist.get_world_size(group) == world:
        return dist.new_group(backend=backend, timeout=timeout)  # the world, in world order
    mine = dist.get_process_group_ranks(group)
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    twin = None
    for ranks in sorted({tuple(r) for r in every}):
        created = dist.new_group(list(ranks), backend=backend, timeout=timeout)
        if list(ranks) == mine:
            twin = created
    return twin


def _timeout_of(group):
    """The timeout of ``group`` (the default group's when None), as its backend holds it;
    None (torch's default) where the backend does not say."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None


def _timeout_s(group) -> float | None:
    timeout = _timeout_of(group)
    return timeout.total_seconds() if timeout is not None else None


class _Then:
    """Work handles waited as one, then ``then()`` once: ``wait()`` may be called again
    (the units of a reduce bucket share one handle) and does nothing more."""

    def __init__(self, *works, then=None):
        self.works, self.then, self.done = works, then, False

    def wait(self) -> None:
        if self.done:
            return
        for w in self.works:
            w.wait()
        if self.then is not None:
            self.then()
        self.done = True


class _Ticket:
    """A collective issued: ``wait()`` checks its fingerprint against every rank's
    ([Note: fingerprints]), then waits for it, reporting a timeout by name
    ([Note: timeouts]), and notes when profiling how long compute waited. The units of
    a reduce bucket share one ticket: the first ``wait()`` counts, later ones return."""

    def __init__(self, comm, work, mine, fp_work, rows, rec):
        self.comm, self.work, self.mine, self.rec = comm, work, mine, rec
        self.fp_work, self.rows, self.done = fp_work, rows, False

    def wait(self) -> None:
        if self.done:
            return
        start = time.perf_counter()
        if self.fp_work is not None:
            watch.wait(self.fp_work, self.comm, self.mine)
            self.fp_work = None
            watch.check_fingerprints(self.comm, self.rows, self.mine)
        if self.work is not None:
            watch.wait(self.work, self.comm, self.mine)
        if self.rec is not None:
            self.rec["done"] = time.perf_counter()
            self.rec["waited"] = self.rec.get("waited", 0.0) + self.rec["done"] - start
        self.done = True
