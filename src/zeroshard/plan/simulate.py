"""The step-time model's simulation (``steptime.py``): one compute stream and one serial
link carrying the data-parallel collectives in issue order; the compute stream waits
on the link only where the engine waits (``runtime/schedule.py``,
``runtime/model.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from ..spec.formulas import ceil_div


class _Link:
    """One serial channel: collectives run one after another in issue order."""

    def __init__(self) -> None:
        self.free = 0.0

    def run(self, issued: float, seconds: float) -> float:
        self.free = max(issued, self.free) + seconds
        return self.free


def _land(t: float, flying: list[tuple[float, float]]) -> float:
    """Wait for the reductions in flight, oldest first, landing each (its copy seconds,
    and with hybrid sharding its all-reduce across replicas, on the compute stream) as
    ``wait_reduce`` does; returns the compute clock."""
    for done, land in flying:
        t = max(t, done) + land
    flying.clear()
    return t


def _pass(t: float, link: _Link, units: int, compute: float, gather: float | None,
          prefetch: int, reduce: Callable[[int], float] | None,
          flying: list[tuple[float, float]], bounded: bool = True, unpack: float = 0.0,
          pack: float = 0.0, land: float = 0.0, upload: float = 0.0, every: int = 1) -> float:
    """One forward (``reduce`` None) or backward pass over ``units`` units; returns the
    compute clock at its end. ``gather`` None: the weights are already whole;
    ``reduce(n)``: seconds of one reduction of n units' gradients, issued once ``every``
    units are done (``Reducer._bucket_add``: a bucket of ``reduce_bucket`` elements) and
    for the rest when the pass ends; ``bounded``: at most two reductions in flight;
    ``unpack``, ``pack``, ``land``: copy seconds per unit of a gather, before a reduction
    is issued, after it is waited; ``upload``: seconds of the shard's copy to the device
    before each gather is issued (offload)."""
    landed: dict[int, float] = {}
    pending = 0  # units done whose reduction waits for a fuller bucket
    for k in range(units):
        if gather is not None:
            if k not in landed:  # gathered on use
                t += upload
                landed[k] = link.run(t, gather)
            t = max(t, landed[k]) + unpack  # Unit.gather: wait, then unpack_into
            for j in range(k + 1, min(units, k + 1 + prefetch)):
                if j not in landed:  # prefetched once this unit's gather has landed
                    t += upload
                    landed[j] = link.run(t, gather)
        t += compute
        if reduce is not None:
            pending += 1
            if pending < every and k < units - 1:
                continue
            t += pending * pack  # issue_reduce packs the bucket, then issues
            flying.append((link.run(t, reduce(pending)), pending * land))
            pending = 0
            if bounded and len(flying) > 2:  # a third in flight: the oldest lands first
                t = _land(t, [flying.pop(0)])
    return t


def units_per_reduction(bucket: int, unit_elements: float, units: int) -> int:
    """Units one reduction carries: one unit where there is no bucket (``bucket`` 0),
    else as many as fill ``bucket`` elements (the reducer issues once a bucket holds at
    least that many), at most all of them."""
    if bucket <= 0 or unit_elements <= 0:
        return 1
    return max(1, min(units, ceil_div(int(bucket), max(1, int(unit_elements)))))


def _sync(t: float, link: _Link, units: int, gather: float, make: float,
          unpack: float) -> float:
    """Stages 1-2 after the step (``ShardedModel.after_step``): per unit its input is
    made (``make`` seconds) and its all-gather issued, then the previous unit's is waited
    and unpacked; the next forward waits for and unpacks the last."""
    prev = None
    for _ in range(units):
        t += make
        done = link.run(t, gather)
        if prev is not None:
            t = max(t, prev) + unpack
        prev = done
    return max(t, prev) + unpack
