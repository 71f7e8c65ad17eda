"""The ledger: bytes this rank sent per collective kind, and bytes held per category.

Communication is counted in the planner's ring accounting (``zeroshard.plan.memory``):
an all-reduce of T bytes sends 2(N-1)/N·T per rank, a reduce-scatter (T = input) or
all-gather (T = output) (N-1)/N·T, a broadcast (N-1)/N·T — whatever the backend moves
underneath (gloo runs reduce-scatter as an all-reduce), so measured and planned bytes
are the same quantity. ``check`` is the engine's own: the fingerprint each rank sends
before every collective (``ZeroConfig.check_collectives``, ``watch.py``) and the small
agreements (a non-finite gradient found); the planner does not count them.
``owner_gather`` and ``owner_scatter`` are an optimizer's whole-matrix step (owner
computes, ``spec/optimizers.py``): all-to-alls, counted as the bytes this rank sends to
the other ranks, which differ by rank (each owns other matrices).

Memory categories (bytes on this rank):

- ``params``: compute weights this rank keeps between steps (full below stage 3, the
  shard at stage 3), padding excluded;
- ``grads``: stored gradients (full below stage 2, the shard from stage 2);
- ``optimizer``: the master copy plus every per-element optimizer state;
- ``padding``: the zeros that make shards equal in size, counted apart, never hidden;
- ``gathered``: full parameters alive right now at stage 3 (transient);
- ``buffers``: communication buffers and fp32 step gradients alive right now (transient).
"""

from __future__ import annotations

from collections import Counter

from ..spec.formulas import ring_all_reduce, ring_one_way

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "owner_gather",
               "owner_scatter", "check")
#: All-to-alls: recorded as the bytes this rank sends to others, not by a ring formula.
POINT_TO_POINT = ("owner_gather", "owner_scatter")
CATEGORIES = ("params", "grads", "optimizer", "padding", "gathered", "buffers")


def ring_bytes(kind: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends for a collective over ``nbytes`` (ring accounting)."""
    if kind == "all_reduce":
        return ring_all_reduce(nbytes, world)
    if kind in ("reduce_scatter", "all_gather", "broadcast", "check"):  # check: an all-gather
        return ring_one_way(nbytes, world)
    if kind in POINT_TO_POINT:
        return nbytes
    raise AssertionError(f"unknown collective kind {kind!r}")


class Ledger:
    """Calls and bytes sent per collective kind and level (``"inside"`` a shard group,
    ``"across"`` shard groups, ``"control"``: the engine's checks); reset with
    :meth:`reset`."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()
        self.sent: Counter[tuple[str, str]] = Counter()

    def record(self, kind: str, nbytes: int, world: int, level: str = "inside") -> None:
        self.calls[kind, level] += 1
        self.sent[kind, level] += ring_bytes(kind, nbytes, world)

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """``{kind: {"calls": n, "bytes": sent}}`` for every kind used so far, over all
        levels."""
        out = {}
        for k in COLLECTIVES:
            calls = sum(v for (kind, _), v in self.calls.items() if kind == k)
            if calls:
                out[k] = {"calls": calls,
                          "bytes": sum(v for (kind, _), v in self.sent.items() if kind == k)}
        return out

    def by_level(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{level: {kind: {"calls": n, "bytes": sent}}}``: inside the shard groups and
        across them (hybrid sharding), and the engine's checks."""
        out: dict = {}
        for (kind, level), calls in sorted(self.calls.items()):
            out.setdefault(level, {})[kind] = {"calls": calls,
                                               "bytes": self.sent[kind, level]}
        return out

    def reset(self) -> None:
        self.calls.clear()
        self.sent.clear()


def tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def optimizer_state_bytes(optimizer, params) -> int:
    """Bytes of the optimizer state held for ``params``: every tensor of one or more
    dimensions (Adam's moments, Adafactor's row and column statistics); scalar counters
    such as Adam's step are not counted. ``optimizer``: one, or a list of them (Muon for
    the matrices and AdamW for the rest)."""
    if optimizer is None:
        return 0
    if isinstance(optimizer, (list, tuple)):
        return sum(optimizer_state_bytes(o, params) for o in optimizer)
    total = 0
    for p in params:
        for value in optimizer.state.get(p, {}).values():
            if hasattr(value, "shape") and value.dim() > 0:
                total += tensor_bytes(value)
    return total
