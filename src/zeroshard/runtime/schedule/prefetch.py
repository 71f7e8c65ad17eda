"""Stage 3's prefetch: the gather order of each pass, recorded, and the gathers issued
ahead of use from it.

[Note: prefetch] A unit's all-gather is issued in its pre-forward (or pre-backward)
hook; right after it, the gathers of the next ``depth`` units *in the order this phase
ran on the previous pass* are issued too, so they travel while the current unit
computes (FSDP2's implicit forward/backward prefetch; DeepSpeed's trace-based
prefetch). The order is recorded afresh on every pass, so a model whose execution
order changes is prefetched by its last pass: a wrong guess costs one unused gather
(released at the end of backward), never a wrong result. ``bucket`` bounds the
elements prefetched at once (DeepSpeed's ``stage3_prefetch_bucket_size``); the next
unit is always allowed.
"""

from __future__ import annotations

from ..unit.unit import Unit, UnitState

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
