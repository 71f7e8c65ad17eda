"""Backward and the gradient reductions: when each unit's reduction is issued, and the
gradients made final for the step.

A unit is done with a backward when every trainable parameter of it has accumulated
its gradient (a post-accumulate-grad hook per parameter) or, for parameters that got
none, when backward ends (a queued autograd callback). Reductions are *issued in a
fixed order* (the reverse of the units' forward order), so every rank issues the same
sequence even when a rank's unused parameter makes a unit finish late there; the
reductions travel on their own process group (``collectives.py``), so they cannot
interleave with stage 3's gathers. What a reduction leaves in the full gradients, and
where the result is kept, is the policy's (``policy.py``); how it is packed is
``reduce.py``'s.
"""

from __future__ import annotations

import torch

from ..unit.unit import Unit, UnitState
from .reduce import issue_reduce


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
