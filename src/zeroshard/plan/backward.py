"""The backward pass unit by unit, as the engine runs it (``runtime/schedule.py``): what
one GPU holds beside its weights and optimizer state at each moment after the loss's
backward.

Block units run backward last block first; the root unit (embeddings, final norm and
head) ends last, its embedding being the first thing the forward used. Block unit j
(j = 1 the last of the n block units) passes three moments:

- **begin**: its saved tensors (checkpointed: one block recomputed too) and those of
  every block unit still to come; at stage 3 it is gathered and the next ``prefetch``
  units' gathers are in flight;
- **end**: its saved tensors are freed and its full gradients made: stage 1 keeps them
  to the step (``grads``), stages 0, 2 and 3 until they are packed;
- **issued**: its gradients packed into a reduction buffer, N slots in the reduce dtype
  and at stages 1-3 the 1/N output (``runtime/schedule.py``). The engine issues a
  reduction and then lands the oldest while more than two are in flight
  (``_flush``): three buffers exist as the third is issued, two after. A landed
  reduction leaves a slot: stage 1's reduced slot in the gradient dtype (``buffers``
  until the step), stages 2-3 the gradient shard, stage 0 the averaged full gradients.
  Stage 0 in the gradients' own dtype has no bound: its buffers hold what the
  gradients they replace held (``policy.bounds_reductions``).

Through the block units the head's weight gradient (V·h) and the final norm's are held:
made at the head's backward, they wait for the embedding's before the root unit is
reduced (a head tied to the embedding in autograd's input buffer of the shared
weight); at stage 3 the root unit
stays gathered, and hpZ keeps the secondary shards of every unit not yet done. The
root unit then ends (every gradient made) and is issued.

Measured with the engine's profiler, Hugging Face GPT-2 (h = 128, 4 layers) at
stage 1 in bf16, N = 2: 12.493 MB when the third block unit's reduction is issued
(grads of three block units, three reduction buffers of 6 bytes a parameter, one block
unit's saved tensors), 1.2 MB above the loss's backward.

The profiler does not see (:attr:`Moment.seen` leaves out) a unit's full gradients at
stages 2-3 before they are packed (the ledger counts only the gradient shard), nor the
head's weight gradient where it is not a stored ``.grad`` of stages 0-1.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.formulas import ceil_div
from ..spec.policy import ShardPolicy
from ..spec.recipes import Recipe

PHASES = ("begin", "end", "issued")



@dataclass(frozen=True)
class Moment:
    """The largest moment of a part of the backward, in bytes beside the held state;
    units numbered as the engine numbers them (the root unit 0, blocks from 1)."""

    bytes: int
    """All that is allocated."""
    at: str
    """Where ``bytes`` is reached, e.g. "unit 2 issued"."""
    seen: int
    """What the engine's profiler counts at its own largest moment."""
    seen_at: str
    """Where ``seen`` is reached."""


@dataclass(frozen=True)
class BackwardPass:
    """The shape of one GPU's backward; sizes in parameters on this GPU, bytes in
    bytes."""

    policy: ShardPolicy
    """What the stage shards and how it reduces (``ZeroConfig.policy``)."""
    dp: int
    """Ranks each category is sharded over (the shard group's)."""
    recipe: Recipe
    units: int
    """Block units n."""
    unit: int
    """Parameters of the largest block unit."""
    root: int
    """Parameters of the root unit (0 for a bare count: every unit a block unit)."""
    head: int
    """Parameters of the output layer's weight (0 for a bare count)."""
    tied: bool
    """The head shares the embedding's weight: its gradient waits in autograd."""
    final_norm: int
    """Parameters of the final norm, whose gradients the head's backward makes too."""
    saved: int
    """Saved bytes of one block unit at the end of the forward."""
    recompute: int = 0
    """Saved bytes of a block recomputed during its unit's backward (checkpointing)."""
    kept: int = 0
    """Saved bytes outliving every block unit's backward (the input ids)."""
    prefetch: int = 1
    """Units gathered ahead while one runs backward (0 where the weights are whole)."""
    accumulating: bool = False
    """Not the step's first backward: the stored gradients exist and are added to."""
    params_offloaded: bool = False
    """Stage 3 with ``offload="params"``: each gather's shard copied up first."""
    secondary_root: int = 0
    """hpZ: the root unit's secondary shards, bytes."""
    secondary_unit: int = 0
    """hpZ: the largest block unit's secondary shards, bytes."""

    def __post_init__(self) -> None:
        if not isinstance(self.policy, ShardPolicy):
            raise ValueError(f"policy={self.policy!r}; expected a ShardPolicy "
                             "(ShardPolicy.for_stage, ZeroConfig.policy)")
        for name in ("dp", "units"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be at least 1")

    @property
    def bounded(self) -> bool:
        """At most three reductions in flight (``policy.bounds_reductions``)."""
        return self.policy.bounds_reductions(self.recipe.grad_bytes, self.recipe.reduce_bytes)

    def _flying(self, issued: int, issuing: bool) -> int:
        return min(issued, 3 if issuing else 2) if self.bounded else issued

    def _buffer(self, params: int) -> int:
        """A reduction in flight: N slots, and at stages 1-3 this rank's output."""
        rb = self.recipe.reduce_bytes
        scatters = self.policy.reduce == "reduce_scatter"
        return params * rb + (ceil_div(params, self.dp) * rb if scatters else 0)

    def _landed(self, params: int) -> int:
        """What a landed reduction leaves beyond the held gradients: with accumulation
        it adds into (stage 1: replaces) the slot already held, stage 0's average
        replaces the local sums it packed."""
        if self.accumulating:
            return 0
        gb = self.recipe.grad_bytes
        return params * gb if self.policy.averages_grads else ceil_div(params, self.dp) * gb

    def _local(self, params: int) -> int:
        """Full gradients a unit's backward makes; at stages 0-1 with accumulation they
        add into the stored ones."""
        if self.accumulating and self.policy.keeps_full_grads:
            return 0
        return params * self.recipe.grad_bytes

    def _head_grads(self) -> tuple[int, int]:
        """(allocated, seen) of the head's and the final norm's gradients through the
        block units: stored ``.grad`` at stages 0-1 (with accumulation added into),
        unseen local gradients at stages 2-3, the tied head's in autograd's buffer."""
        gb = self.recipe.grad_bytes
        real = seen = 0
        for params, stored in ((self.head, not self.tied), (self.final_norm, True)):
            if stored and self.policy.keeps_full_grads:
                if not self.accumulating:
                    real, seen = real + params * gb, seen + params * gb
            else:
                real += params * gb
        return real, seen

    def _arriving(self, j: int) -> int:
        """Stage 3: gathers in flight during block unit j's backward."""
        wb = self.recipe.weight_bytes
        one = self.unit * wb + (ceil_div(self.unit, self.dp) * wb if self.params_offloaded
                                else 0)
        return min(self.prefetch, self.units - j) * one

    def block(self, j: int, phase: str) -> tuple[int, int]:
        """(allocated, seen) at ``phase`` of block unit ``j`` (1 = the last)."""
        n, wb = self.units, self.recipe.weight_bytes
        done = j - (phase == "begin")  # block units whose gradients are made
        issued = j - (phase != "issued")
        fly = self._flying(issued, phase == "issued")
        local = self._local(self.unit)
        seen = ((n - done) * self.saved + self.kept
                + (self.recompute if phase == "begin" else 0)
                + fly * self._buffer(self.unit) + (issued - fly) * self._landed(self.unit)
                + self.secondary_root + (n - done) * self.secondary_unit)
        policy = self.policy
        if policy.keeps_local_grads:
            seen += done * local
        if policy.shards_params:
            seen += (self.root * wb + self._arriving(j)
                     + (0 if phase == "issued" else self.unit * wb))
        loose = local if phase == "end" and not policy.keeps_local_grads else 0
        head_real, head_seen = self._head_grads()
        return (seen + loose + head_real,
                seen + (loose if policy.averages_grads else 0) + head_seen)

    def root_unit(self, phase: str) -> tuple[int, int]:
        """(allocated, seen) as the root unit's backward ends or its reduction is
        issued (phase ``"end"`` or ``"issued"``), every block unit done."""
        n, issuing = self.units, phase == "issued"
        fly = self._flying(n + issuing, issuing) - issuing  # block units' in flight
        seen = fly * self._buffer(self.unit) + (n - fly) * self._landed(self.unit)
        if issuing:
            seen += self._buffer(self.root)
        else:
            seen += self.secondary_root
            if self.policy.shards_params:
                seen += self.root * self.recipe.weight_bytes
        local = self._local(self.root)
        if self.policy.keeps_local_grads:
            seen += n * self._local(self.unit) + local
            return seen, seen
        loose = 0 if issuing else local
        return seen + loose, seen + (loose if self.policy.averages_grads else 0)

    def _candidates(self) -> list[int]:
        """Block units where a largest moment can be: each moment is linear in j once
        the reductions in flight and the gathers arriving stop changing."""
        n = self.units
        return sorted({j for j in (1, 2, 3, *range(n - self.prefetch - 1, n + 1))
                       if 1 <= j <= n})

    def blocks_moment(self) -> Moment:
        """The largest moment of the block units' backward."""
        moments = [(self.block(j, p), f"unit {self.units - j + 1} {p}")
                   for j in self._candidates() for p in PHASES]
        return _largest(moments)

    def end_moment(self) -> Moment:
        """The largest moment of the root unit's backward and its reduction."""
        return _largest([(self.root_unit(p), f"unit 0 {p}") for p in ("end", "issued")])


def _largest(moments: list[tuple[tuple[int, int], str]]) -> Moment:
    (real, _), at = max(moments, key=lambda m: m[0][0])
    (_, seen), seen_at = max(moments, key=lambda m: m[0][1])
    return Moment(real, at, seen, seen_at)
