"""The order of a pass's collectives: the collectives in flight per unit (the comm
context), each unit's gradient reduction issued in one order on every rank (alone or
in a bucket), and stage 3's gathers issued ahead of use (prefetch).
"""

from __future__ import annotations

import torch

from .unit import Unit, UnitState, local_grads

# ----------------------------------------------------------------------------------------
# The comm context: what orders a model's collectives against its compute.
#
# [Note: comm context] Three kinds of collective run beside the model's compute, each
# issued by a unit and landed by it later:
#
# | kind   | issued                                     | landed                          |
# |--------|--------------------------------------------|---------------------------------|
# | gather | stage 3: a unit's all-gather, on use or    | before the unit computes        |
# |        | ahead of it (prefetch)                     |                                 |
# | reduce | a unit's gradient reduction, once its      | before the next backward or the |
# |        | backward is done                           | step                            |
# | sync   | stages 1-2: the all-gather of updated rows | before the next forward         |
# |        | after the step                             |                                 |
#
# The context holds every collective in flight — its work handle and the buffers it
# reads and writes, which must live until it lands — per kind and unit, and is the one
# place that waits for them. So the order in which communication and compute meet is
# decided here and nowhere else: on the CPU a work handle's ``wait()`` is that order
# (gloo runs collectives on its own threads); on a GPU the same three kinds are where a
# stream per kind and the events that join it to the compute stream belong (FSDP2's
# ``FSDPCommContext`` holds its all-gather and reduce-scatter streams alike), with no
# unit, reducer or prefetcher changed.
# ----------------------------------------------------------------------------------------

#: The kinds of collective a unit has in flight (see the note).
KINDS = ("gather", "reduce", "sync")


class CommContext:
    """The collectives in flight of one sharded model, by kind and unit index."""

    def __init__(self) -> None:
        self._flight: dict[str, dict[int, tuple]] = {k: {} for k in KINDS}

    def issue(self, kind: str, unit: int, work, *buffers: torch.Tensor) -> None:
        """Hold ``work`` and its ``buffers`` until :meth:`land`. A unit has at most one
        collective of a kind in flight: the engine lands the last before the next."""
        assert unit not in self._flight[kind], f"unit {unit} already has a {kind} in flight"
        self._flight[kind][unit] = (work, buffers)

    def pending(self, kind: str, unit: int) -> bool:
        return unit in self._flight[kind]

    def land(self, kind: str, unit: int) -> tuple | None:
        """Wait for ``unit``'s collective of ``kind``; return its buffers (None when none
        is in flight). The units of a reduce bucket share one work handle: its first
        wait lands it, the others return at once."""
        held = self._flight[kind].pop(unit, None)
        if held is None:
            return None
        work, buffers = held
        work.wait()
        return buffers

    def advance(self, kind: str, unit: int, *keep: torch.Tensor) -> bool:
        """A two-stage collective (hybrid sharding's reduction: inside the shard group,
        then across replicas): land its first stage and start the second without waiting,
        keeping only ``keep`` of its buffers alive. False where the collective has one
        stage (the caller lands it instead)."""
        work, _ = self._flight[kind][unit]
        if not hasattr(work, "advance"):
            return False
        work.advance()
        self._flight[kind][unit] = (work, keep)
        return True

    def buffers(self, unit: int) -> list[torch.Tensor]:
        """Every buffer ``unit``'s collectives in flight hold (the ledger counts them)."""
        return [t for kind in KINDS if unit in self._flight[kind]
                for t in self._flight[kind][unit][1]]


# ----------------------------------------------------------------------------------------
# Issuing gradient reductions: a bucket of units, one collective.
#
# The engine (``sharded.py``) decides *when* a unit's reduction is issued (in a fixed
# order, every rank the same); this module packs the units' local gradients into one
# communication buffer and starts the collective the policy names over it.
# Each unit lands its share later in :meth:`Unit.wait_reduce`.
# ----------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------
# Backward and the gradient reductions: when each unit's reduction is issued, and the
# gradients made final for the step.
#
# A unit is done with a backward when every trainable parameter of it has accumulated
# its gradient (a post-accumulate-grad hook per parameter) or, for parameters that got
# none, when backward ends (a queued autograd callback). Reductions are *issued in a
# fixed order* (the reverse of the units' forward order), so every rank issues the same
# sequence even when a rank's unused parameter makes a unit finish late there; the
# reductions travel on their own process group (``collectives.py``), so they cannot
# interleave with stage 3's gathers. What a reduction leaves in the full gradients, and
# where the result is kept, is the policy's (``policy.py``); how it is packed is
# ``reduce.py``'s.
# ----------------------------------------------------------------------------------------

class Reducer:
    """The reduction order and buckets of one sharded model's units."""

    def __init__(self, units: list[Unit], bucket_size: int):
        self.units = units
        self.order = list(reversed(units))  # reductions: the reverse of forward
        self.bucket_size = bucket_size
        u0 = units[0]
        self.bounded = u0.policy.bounds_reductions(u0.grad_dtype.itemsize,
                                                   u0.reduce_dtype.itemsize)
        self.sync = True  # False inside no_sync(): nothing is issued
        self._next = 0  # the first unit of ``order`` not issued in this backward
        self._bucket: list[Unit] = []  # ready units whose reduction waits for more
        self._flying: list[list[Unit]] = []  # issued reductions, oldest first

    def begin(self, new_cycle: bool) -> None:
        """A backward begins: land what the last one left in flight (stage 0 writes
        back into the gradients this backward adds to), reset each unit's count."""
        self._next = 0
        for u in self.units:
            u.wait_reduce()
            u.start_backward(new_cycle)
        self._flying = []

    def on_grad(self, unit: Unit) -> None:
        """A trainable parameter of ``unit`` has accumulated its gradient."""
        if unit.grad_arrived():
            unit.backward_done()
            self._issue_ready()

    def _issue_ready(self, flush: bool = False) -> None:
        """Issue reductions strictly in ``order``: the same sequence on every rank."""
        while self._next < len(self.order) and (self.order[self._next].ready
                                                or not self.order[self._next].trainable):
            # a unit with no trainable parameter has nothing to reduce: it holds none back
            if self.sync and self.order[self._next].trainable:
                self._bucket_add(self.order[self._next])
            self._next += 1
        if flush:
            self._flush()

    def _bucket_add(self, unit: Unit) -> None:
        self._bucket.append(unit)
        if sum(u.g_layout.numel for u in self._bucket) >= self.bucket_size:
            self._flush()

    def _flush(self) -> None:
        """Issue the pending bucket. Where the policy bounds them, at most two
        reductions stay in flight once it is issued: the third is issued first, so it
        overlaps the oldest's wait, and then the oldest is landed (its buffer freed). So
        at most three buffers exist at once, never another copy of the gradients
        (``zeroshard.plan.backward`` plans exactly these three).
        Under hybrid sharding its all-reduce across replica groups, on the reduced slot
        only, then runs on while backward goes on (``Unit.advance_reduce``)."""
        if self._bucket:
            issue_reduce(self._bucket)
            self._flying.append(self._bucket)
            self._bucket = []
            while self.bounded and len(self._flying) > 2:
                for u in self._flying.pop(0):
                    u.advance_reduce()  # landed; under hybrid its across still in flight

    def end(self) -> None:
        """Backward has ended: units with unused parameters are done now, the last
        bucket goes, and units gathered but not used by this backward are released."""
        for u in self.order[self._next:]:
            if not u.ready:
                u.backward_done()
        self._issue_ready(flush=True)
        for u in self.units:
            if u.policy.shards_params and u.state is not UnitState.SHARDED:
                u.release()  # used by no backward this step, or prefetched and unused
            u.drop_secondary()  # hpZ: a unit this backward did not reach keeps none

    def finalize(self, unreduced: bool) -> None:
        """Finish every reduction and give each shard its gradient; ``unreduced``: the
        last backward ran under ``no_sync()`` and its gradients are reduced now."""
        if unreduced:
            for u in self.order:
                self._bucket_add(u)
            self._flush()
        for u in self.order:
            u.wait_reduce()
        # Which parameters some rank saw (a parameter no rank used gets no update, as
        # under torch DDP): one host synchronisation for all units at once. Averaged
        # full gradients have had their flags read as they landed (Unit._land_full_grads).
        counted = [u for u in self.order if u.presence is not None]
        if counted:
            present = (torch.cat([u.presence for u in counted]) > 0).tolist()
            for u in counted:
                u.assign_step_grads(present[:len(u.trainable)])
                present = present[len(u.trainable):]
        self._flying = []


# ----------------------------------------------------------------------------------------
# Stage 3's prefetch: the gather order of each pass, recorded, and the gathers issued
# ahead of use from it.
#
# [Note: prefetch] A unit's all-gather is issued in its pre-forward (or pre-backward)
# hook; right after it, the gathers of the next ``depth`` units *in the order this phase
# ran on the previous pass* are issued too, so they travel while the current unit
# computes (FSDP2's implicit forward/backward prefetch; DeepSpeed's trace-based
# prefetch). The order is recorded afresh on every pass, so a model whose execution
# order changes is prefetched by its last pass: a wrong guess costs one unused gather
# (released at the end of backward), never a wrong result. ``bucket`` bounds the
# elements prefetched at once (DeepSpeed's ``stage3_prefetch_bucket_size``); the next
# unit is always allowed.
# ----------------------------------------------------------------------------------------

PHASES = ("forward", "backward")


class Prefetcher:
    """Per phase: the order units were gathered in on the last pass and on this one."""

    def __init__(self, depth: int, bucket: int):
        self.depth, self.bucket = depth, bucket
        self.order: dict[str, list[Unit]] = {p: [] for p in PHASES}
        self.seen: dict[str, list[Unit]] = {p: [] for p in PHASES}

    def use(self, unit: Unit, phase: str) -> None:
        """Gather ``unit`` for use in ``phase``, then prefetch the units that followed it
        on the previous pass of that phase."""
        seen, order = self.seen[phase], self.order[phase]
        seen.append(unit)
        unit.gather()
        if not self.depth or unit not in order:
            return
        # where this pass is in the last one: by position while the two agree
        k = len(seen) - 1 if len(seen) <= len(order) and order[len(seen) - 1] is unit \
            else order.index(unit)
        held = 0
        for nxt in order[k + 1:k + 1 + self.depth]:
            held += nxt.w_layout.numel
            if self.bucket and held > self.bucket and nxt is not order[k + 1]:
                break
            if nxt.state is UnitState.SHARDED:
                nxt.start_gather(prefetch=True)

    def end_pass(self, phase: str) -> None:
        """This pass's order becomes the one the next pass prefetches by."""
        if self.seen[phase]:
            self.order[phase], self.seen[phase] = self.seen[phase], []
