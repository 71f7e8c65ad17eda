"""The comm context: what orders a model's collectives against its compute.

[Note: comm context] Three kinds of collective run beside the model's compute, each
issued by a unit and landed by it later:

| kind   | issued                                     | landed                          |
|--------|--------------------------------------------|---------------------------------|
| gather | stage 3: a unit's all-gather, on use or    | before the unit computes        |
|        | ahead of it (prefetch)                     |                                 |
| reduce | a unit's gradient reduction, once its      | before the next backward or the |
|        | backward is done                           | step                            |
| sync   | stages 1-2: the all-gather of updated rows | before the next forward         |
|        | after the step                             |                                 |

The context holds every collective in flight — its work handle and the buffers it
reads and writes, which must live until it lands — per kind and unit, and is the one
place that waits for them. So the order in which communication and compute meet is
decided here and nowhere else: on the CPU a work handle's ``wait()`` is that order
(gloo runs collectives on its own threads); on a GPU the same three kinds are where a
stream per kind and the events that join it to the compute stream belong (FSDP2's
``FSDPCommContext`` holds its all-gather and reduce-scatter streams alike), with no
unit, reducer or prefetcher changed.
"""

from __future__ import annotations

import torch

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
