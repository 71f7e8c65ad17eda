"""Every collective the engine issues, recorded and fingerprinted in one place; the
in-place reduce-scatter and all-gather it builds on gloo; tensor parallelism's own
collectives counted for the ledger.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _pop_mode,
    _push_mode,
)

from ..spec.formulas import GLOO_BROADCAST_MAX
from . import watch
from .cycle import StepCycle
from .ledger import Ledger
from .mesh import Mesh
from .quantize import QUANT_BLOCK, quantized_all_gather, quantized_nbytes, quantized_reduce_scatter

# ----------------------------------------------------------------------------------------
# The reduce-scatter and all-gather the engine runs on CPU tensors over gloo
# (``Collectives`` chooses them; each builder issues its collective asynchronously and
# returns one waitable).
#
# [Note: gloo] torch's gloo reduce-scatter and all-gather stage their data through extra
# full-size copies; the engine's use gloo's in-place collectives and point-to-point sends:
#
# - gloo's reduce-scatter runs an all-reduce on a copy of its input. An all-reduce of the
#   input in place, then this rank's slot copied out, sums every element in the same
#   order (the same bits) without the copy; ``bench/gloo_collectives.py`` on 2 CPU cores,
#   2-4 ranks, a 7 MB buffer: 0.70-0.85x the time, and no copy of the input in flight
#   (:func:`all_reduce_slot`).
# - Between two ranks it is an exchange instead (:func:`exchange_slots`): each rank sends
#   the other the slot it does not keep and receives its own into the output, then adds
#   its own part — half the bytes of the all-reduce (which also sends the summed slots
#   back), and the same bits, as a + b = b + a in floating point. 43 MB at 2 ranks:
#   0.46-0.49x the all-reduce's time and CPU. From three ranks a ring of sends would add
#   in another order than the all-reduce torch DDP makes (stages 1-3 would no longer match
#   it, nor stage 0, bit for bit), so it stays the all-reduce there.
# - gloo's all-gather gathers into a fresh flat buffer the size of the output and copies
#   it out when done. N broadcasts in place, rank k's from rank k into slot k of the
#   output (:func:`broadcast_slots`), move the same bytes per rank and need no buffer:
#   0.66-0.80x the time, and one output-sized buffer less in flight (at stage 3 a
#   prefetched unit held twice its size). Up to ``GLOO_BROADCAST_MAX`` ranks only, the
#   range measured: each broadcast is a binomial tree of ⌈log2 N⌉ hops, and past a few
#   ranks N of them, two at a time on gloo's worker threads, are not known to beat its
#   all-gather.
# ----------------------------------------------------------------------------------------

class Then:
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


def exchange_slots(out: torch.Tensor, inp: torch.Tensor, group, rank: int, seq: int,
                   divisor: int | None) -> Then:
    """Two ranks' reduce-scatter: ``inp`` [2·S] holds this rank's part of both slots;
    ``out`` [S] receives the sum of slot ``rank`` (divided by ``divisor``, if any).
    ``seq``, the collective's number, alike on both ranks, tags the two messages."""
    peer, dst, slots = 1 - rank, out.view(-1), inp.view(2, -1)
    tag = seq % 2**31
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, slots[peer], group=group, group_peer=peer, tag=tag),
        dist.P2POp(dist.irecv, dst, group=group, group_peer=peer, tag=tag)])

    def then():
        dst.add_(slots[rank])  # the peer's part + this rank's: the sum's bits
        if divisor:
            dst.div_(divisor)
    return Then(*works, then=then)


def all_reduce_slot(out: torch.Tensor, inp: torch.Tensor, group, k: int, rank: int,
                    divisor: int | None) -> Then:
    """K ranks' reduce-scatter: ``inp`` [K·S] is summed in place (every slot holds the
    group's sums afterwards) and slot ``rank`` lands in ``out``, divided as it is copied."""
    work = dist.all_reduce(inp, group=group, async_op=True)
    slot, dst = inp.view(k, -1)[rank], out.view(-1)
    return Then(work, then=(lambda: torch.div(slot, divisor, out=dst)) if divisor
                else (lambda: dst.copy_(slot)))


def broadcast_slots(out: torch.Tensor, inp: torch.Tensor, group, k: int, rank: int) -> Then:
    """K ranks' all-gather: ``out`` [K, ·] receives rank j's ``inp`` in slot j by K
    broadcasts in place (``inp`` may already be this rank's slot of ``out``)."""
    slots = out.view(k, -1)
    if slots[rank].data_ptr() != inp.data_ptr():
        slots[rank].copy_(inp.view(-1))
    return Then(*[dist.broadcast(slots[j], group_src=j, group=group, async_op=True)
                  for j in range(k)])


# ----------------------------------------------------------------------------------------
# Every collective the engine issues goes through :class:`Collectives`, which records
# it in the ledger. Gradients and parameters travel on separate process groups so that
# a rank whose reductions start late (an unused parameter) cannot pair its reduce with
# another rank's gather: each group sees its collectives in the same order on every rank.
#
# On CPU tensors over gloo, reduce-scatter and all-gather run as ``gloo.py`` builds them
# ([Note: gloo]): in place, and between two ranks as an exchange.
#
# The ledger records the collective the algorithm performs (ZeRO's accounting), so
# measured and planned bytes stay the same quantity whatever the backend runs.
# ----------------------------------------------------------------------------------------

# torch 2.13 renamed these; the old names warn. Older releases only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Collectives:
    """A model's process groups (``mesh.py``) and every collective it issues on them,
    recorded in the ledger by kind and level: ``"inside"`` a shard group,
    ``"across"`` shard groups (hybrid sharding's replica all-reduce), or ``"tp"`` (the
    tensor-parallel group: the engine's own sums there, and the collectives DTensor
    issues inside the model, counted by ``tpcount.py``)."""

    def __init__(self, ledger: Ledger, mesh: Mesh, check: bool = True,
                 quantize_weights: bool = False, quantize_grads: bool = False,
                 quant_block: int = QUANT_BLOCK, cycle: StepCycle | None = None):
        self.ledger = ledger
        self.mesh = mesh  # every group, rank and size (``mesh.py``)
        self.check = check  # fingerprint every collective ([Note: fingerprints])
        # ZeRO++'s qwZ and qgZ (``quantize.py``): int8 blocks with fp32 scales
        self.quant_weights, self.quant_grads, self.quant_block = (
            quantize_weights, quantize_grads, quant_block)
        self.seq = 0  # collectives issued: the fingerprints' first field
        # where the model is (its phase and step), read for the fingerprints
        self.cycle = cycle if cycle is not None else StepCycle()
        self.unit_names: list[str] = []
        self.trace: list[dict] | None = None  # profiling: one record per call

    def _issue(self, kind: str, t: torch.Tensor, unit, call, async_op: bool, value: int = 0,
               world: int | None = None, level: str = "inside", nbytes: int | None = None,
               numel: int | None = None):
        """Record the call in the ledger (and, when profiling, in the collective trace),
        issue its fingerprint, then ``call()``, which issues the collective itself
        asynchronously and returns its work handle (None: the fingerprint is all).
        ``numel``: the size every rank fingerprints, where ``t``'s differs by rank."""
        if nbytes is None:  # a quantized collective says what it sends
            nbytes = t.numel() * t.element_size()
        if call is not None:  # an agreement is its fingerprint: recorded below
            self.ledger.record(kind, nbytes, world or self.mesh.shard_world, level)
        self.seq += 1
        rec = None
        if self.trace is not None:
            rec = {"kind": kind, "unit": unit, "bytes": nbytes, "issued": time.perf_counter()}
            self.trace.append(rec)
        numel = t.numel() if numel is None else numel
        mine, rows, fp_work = watch.fingerprint(self, kind, unit, numel, value), None, None
        if self.check or call is None:
            n = self.mesh.control_world  # every rank of the mesh beside tensor parallelism
            rows = torch.empty(n, watch.WIDTH, dtype=torch.int64)
            self.ledger.record("check", rows.numel() * rows.element_size(), n, "control")
            fp_work = _all_gather(rows.view(-1), mine, group=self.mesh.control_group, async_op=True)
        ticket = _Ticket(self, call() if call is not None else None, mine, fp_work, rows, rec)
        if not async_op:
            ticket.wait()
            return None
        return ticket

    def all_reduce(self, t: torch.Tensor, *, op=dist.ReduceOp.SUM, grads: bool = False,
                   async_op: bool = False, unit=None, tp: bool = False):
        """Reduce ``t`` in place (a sum unless ``op`` says otherwise) over the shard group:
        what every rank's shards add up to. With ``grads``, over the whole data-parallel
        group (every rank's gradients): on the reduction group, then across replicas.
        With ``tp``, over the tensor-parallel group (level ``"tp"``): what every tp
        rank's slices add up to."""
        if tp:
            group = self.mesh.tp_group
            return self._issue("all_reduce", t, unit, lambda: dist.all_reduce(
                t, op=op, group=group, async_op=True), async_op, world=self.mesh.tp_world,
                level="tp")
        group = self.mesh.reduce_group if grads else self.mesh.shard_group
        inside = self._issue("all_reduce", t, unit, lambda: dist.all_reduce(
            t, op=op, group=group, async_op=True), True)
        return self._then_across(inside, t, None, unit, grads, async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, *, mean: bool = False,
                       async_op: bool = False, unit=None):
        """``out`` (1/K of ``inp``, K the shard group's size) receives the sum over the
        data-parallel group of this rank's slot — summed inside the shard group, then
        across the replica groups — or with ``mean`` that sum divided by N (in the wait,
        the same bits as dividing after it). On gloo ([Note: gloo]) two ranks exchange
        slots, the received one landing in ``out``; from three, ``inp`` is summed in place
        (every slot: it holds the shard group's sums afterwards) and the slot lands in
        ``out`` divided and copied in one pass. Either way ``inp`` is not this rank's to
        reuse until the wait."""
        n, k = self.mesh.dp_world, self.mesh.shard_world
        divisor = n if mean and self.mesh.replica_group is None else None  # hybrid: after across
        if self.quant_grads and k > 1:  # qgZ: an all-to-all of int8 blocks, summed in fp32
            def call():
                return quantized_reduce_scatter(out.view(-1), inp.view(-1), self.mesh.reduce_group,
                                                self.quant_block, mean_divisor=divisor,
                                                async_op=True)
            inside = self._issue("reduce_scatter", inp, unit, call, True,
                                 nbytes=k * quantized_nbytes(out.numel(), self.quant_block))
        elif self._on_gloo(inp) and k == 2:  # [Note: gloo]: an exchange of slots
            inside = self._issue("reduce_scatter", inp, unit, lambda: exchange_slots(
                out, inp, self.mesh.reduce_group, self.mesh.shard_rank, self.seq, divisor),
                True)
        elif self._on_gloo(inp):  # [Note: gloo]: an all-reduce in place
            inside = self._issue("reduce_scatter", inp, unit, lambda: all_reduce_slot(
                out, inp, self.mesh.reduce_group, k, self.mesh.shard_rank, divisor), True)
        else:
            def call():
                work = _reduce_scatter(out.view(-1), inp.view(-1), group=self.mesh.reduce_group,
                                       async_op=True)
                return Then(work, then=(lambda: out.div_(divisor)) if divisor else None)
            inside = self._issue("reduce_scatter", inp, unit, call, True)
        return self._then_across(inside, out.view(-1), n if mean else None, unit, True,
                                 async_op)

    def _then_across(self, inside, t: torch.Tensor, divisor, unit, grads: bool,
                     async_op: bool):
        """A reduction inside the shard group, followed under hybrid sharding by the
        all-reduce of ``t`` across the replica groups ([Note: hybrid sharding] in
        ``mesh.py``): one waitable for both, whose ``advance()`` lands the first and
        issues the second without waiting for it, so it overlaps what follows."""
        work = (_Across(self, inside, t, divisor, unit)
                if grads and self.mesh.replica_group is not None else inside)
        if not async_op:
            work.wait()
            return None
        return work

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = False,
                   unit=None, secondary: bool = False, weights: bool = False):
        """``out`` (K × ``inp``) receives every shard-group rank's ``inp`` in rank order;
        with ``secondary`` (hpZ), every secondary-group rank's (K2 × ``inp``). Stage 3's
        gathers of the ``weights`` are quantized under qwZ."""
        k, group = self.mesh.shard_world, self.mesh.shard_group
        if weights and self.quant_weights and not secondary and k > 1:
            return self._issue("all_gather", out, unit, lambda: quantized_all_gather(
                out.view(-1), inp.view(-1), group, self.quant_block, async_op=True), async_op,
                nbytes=k * quantized_nbytes(inp.numel(), self.quant_block))
        if secondary:
            k, group = self.mesh.secondary_world, self.mesh.secondary_group
        rank = self.mesh.secondary_rank if secondary else self.mesh.shard_rank
        if self.mesh.gloo and out.device.type == "cpu" and 1 < k <= GLOO_BROADCAST_MAX:
            def call():  # [Note: gloo]: N broadcasts in place
                return broadcast_slots(out, inp, group, k, rank)
        else:
            def call():
                return _all_gather(out.view(-1), inp.view(-1), group=group, async_op=True)
        return self._issue("all_gather", out, unit, call, async_op, world=k,
                           level="secondary" if secondary else "inside")

    def gather_tp(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every tp rank's ``t`` (slices of one size), concatenated on ``dim`` in tp rank
        order: a tensor-parallel parameter whole again."""
        out = torch.empty(self.mesh.tp_world * t.numel(), dtype=t.dtype, device=t.device)
        inp = t.contiguous().view(-1)
        self._issue("all_gather", out, None, lambda: _all_gather(
            out, inp, group=self.mesh.tp_group, async_op=True), False,
            world=self.mesh.tp_world, level="tp")
        return torch.cat(out.view(self.mesh.tp_world, *t.shape).unbind(0), dim=dim)

    def record_tp(self, kind: str, nbytes: int, world: int) -> None:
        """A collective DTensor issued for tensor parallelism, over ``world`` ranks, in
        the ledger's ``"tp"`` level ([Note: counting tensor-parallel collectives] in
        ``tpcount.py``)."""
        self.ledger.record(kind, nbytes, world, "tp")

    def agree(self, value: int):
        """Start gathering every rank's ``value`` (one small all-gather on the host, with
        its fingerprint); the returned function waits for it and returns them in rank
        order."""
        ticket = self._issue("check", torch.empty(0, dtype=torch.int64), None, None, True,
                             value=value)
        return lambda: (ticket.wait(), ticket.rows[:, -1].tolist())[1]

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                   in_splits: list[int], kind: str, total: int, async_op: bool = False):
        """Over the shard group: ``inp``'s k-th of ``in_splits`` goes to rank k, and
        ``out`` receives rank k's piece in its k-th of ``out_splits`` (1D tensors). An
        optimizer's owner-computes step (``kind``: ``owner_gather`` or ``owner_scatter``),
        recorded as the bytes this rank sends to the other ranks; ``total``: the elements
        of every rank's pieces together, which every rank fingerprints alike."""
        me, item = self.mesh.shard_rank, inp.element_size()
        sent = (sum(in_splits) - in_splits[me]) * item
        return self._issue(kind, inp, None, lambda: dist.all_to_all_single(
            out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
            group=self.mesh.shard_group, async_op=True), async_op, nbytes=sent,
            numel=total)

    def _on_gloo(self, t: torch.Tensor) -> bool:
        return self.mesh.gloo and t.device.type == "cpu" and self.mesh.shard_world > 1

    def broadcast(self, t: torch.Tensor, src: int = 0, tp: bool = False):
        """Copy rank ``src``'s ``t`` to every data-parallel rank (with ``tp``: tp rank
        ``src``'s to every tp rank)."""
        group, world = ((self.mesh.tp_group, self.mesh.tp_world) if tp else
                        (self.mesh.dp_group, self.mesh.dp_world))
        root = dist.get_global_rank(group, src) if group is not None else src
        return self._issue("broadcast", t, None, lambda: dist.broadcast(
            t, src=root, group=group, async_op=True), False, world=world,
            level="tp" if tp else "inside")


class _Across:
    """Hybrid sharding's two-level reduction as one waitable: ``advance()`` lands the
    reduction inside the shard group and issues the all-reduce across replica groups;
    ``wait()`` also waits for that, then divides into the mean. Idempotent, as the units
    of a reduce bucket share one."""

    def __init__(self, comm, inside, t: torch.Tensor, divisor, unit):
        self.comm, self.inside, self.t, self.divisor, self.unit = comm, inside, t, divisor, unit
        self.across, self.done = None, False

    def advance(self) -> None:
        if self.across is None:
            self.inside.wait()
            comm, t, mesh = self.comm, self.t, self.comm.mesh
            self.across = comm._issue("all_reduce", t, self.unit, lambda: dist.all_reduce(
                t, group=mesh.replica_group, async_op=True), True, world=mesh.replica_world,
                level="across")

    def wait(self) -> None:
        if self.done:
            return
        self.advance()
        self.across.wait()
        if self.divisor is not None:
            self.t.div_(self.divisor)
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


# ----------------------------------------------------------------------------------------
# Tensor parallelism's own collectives, counted for the ledger's ``"tp"`` level.
#
# [Note: counting tensor-parallel collectives] The all-reduces, all-gathers and
# reduce-scatters of tensor parallelism are issued by DTensor inside the model's forward
# and backward (a ``RowwiseParallel`` output made ``Replicate()``, the ``Partial()`` input
# gradient of a ``ColwiseParallel`` layer, ``SequenceParallel``'s gathers), as
# ``_c10d_functional`` ops, never through the engine's :class:`Collectives`. They are
# counted where torch counts them itself (``CommDebugMode`` in
# ``torch/distributed/tensor/debug/_comm_mode.py``): a dispatch mode that sees every op
# and records the ``_c10d_functional`` collectives, bytes in ring accounting over their
# group. The mode is on from the model's forward (``hooks.py``) to the optimizer step,
# so the backward, which runs under the thread state of the ``.backward()`` call, is
# seen too; a forward without gradients ends it at once. Only while a tp axis exists:
# without one the model runs with no mode at all.
# ----------------------------------------------------------------------------------------

#: ``_c10d_functional`` op -> (ledger kind, whether its output holds the bytes that count:
#: an all-gather's T is its output, a reduce-scatter's and an all-reduce's their input).
KINDS = {"all_reduce": ("all_reduce", False), "all_reduce_": ("all_reduce", False),
         "all_gather_into_tensor": ("all_gather", True),
         "reduce_scatter_tensor": ("reduce_scatter", False),
         "broadcast": ("broadcast", False), "broadcast_": ("broadcast", False)}


def _watched() -> dict:
    """The ``_c10d_functional`` op overloads of :data:`KINDS` -> (kind, output counts)."""
    import torch

    ops = torch.ops._c10d_functional
    return {getattr(ops, name).default: kind for name, kind in KINDS.items()
            if hasattr(ops, name)}


class _Mode(TorchDispatchMode):
    def __init__(self, comm) -> None:
        super().__init__()
        self.comm = comm
        self.watched = _watched()  # one dict lookup per op: the mode sees every op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **kwargs) if kwargs else func(*args)
        kind = self.watched.get(func)
        if kind is not None:
            t = out if kind[1] else args[0]
            name = kwargs.get("group_name", args[-1]) if kwargs else args[-1]
            group = dist.distributed_c10d._resolve_process_group(name)
            self.comm.record_tp(kind[0], t.numel() * t.element_size(), group.size())
        return out


class TPCounter:
    """The dispatch mode of one sharded model, on from a forward to the step (see the
    note); a listener of the model's events for the step."""

    def __init__(self, comm) -> None:
        self.mode = _Mode(comm)
        self.on = False

    def start(self) -> None:
        if not self.on:
            _push_mode(self.mode)
            self.on = True

    def stop(self) -> None:
        """Off, where it is the innermost mode (a mode the user entered since stays
        theirs; the next forward finds this one still on)."""
        if self.on and _get_current_dispatch_mode() is self.mode:
            _pop_mode()
            self.on = False

    def event(self, kind: str, unit=None, **info) -> None:
        if kind == "step_begin":
            self.stop()
