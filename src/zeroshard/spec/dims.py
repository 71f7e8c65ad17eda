"""The sizes of a run's parallel axes, checked once: :class:`ParallelDims`.

[Note: dims] A run of ``world`` ranks is laid out as ``dp × tp``: tensor parallelism of
degree ``tp`` splits each layer's matrices inside a group of ``tp`` ranks, and the
``dp = world / tp`` data-parallel ranks hold copies of what tensor parallelism leaves.
The data-parallel axis is itself ``replicate × shard``: ZeRO shards each category the
stage names over a *shard group* of ``K`` consecutive ranks, and the ``R = dp / K``
shard groups replicate it (hybrid sharding; ``K = dp`` is plain ZeRO, ``K = 1`` DDP).
hpZ (ZeRO++) cuts each shard group into *secondary groups* of ``K2`` consecutive ranks.

torchtitan's ``ParallelDims`` plays the same part: the planner reads the sizes from
here, and the engine's ``runtime/mesh.py`` builds one process group per axis from them,
so both count ranks the same way.
"""

from __future__ import annotations

from dataclasses import dataclass


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def check_tp_degree(tp: int, label: str, sizes: dict[str, int]) -> None:
    """Tensor parallelism of degree ``tp`` splits each of ``sizes`` (what its plan cuts:
    heads, key/value heads, widths, the vocabulary) into equal parts: a ValueError
    naming the first it does not divide, with the degrees that would. One rule for the
    trainer (the model it builds) and the planner (the architecture it plans)."""
    for what, n in sizes.items():
        if n % tp:
            ok = [d for d in _divisors(n) if d <= 64]
            raise ValueError(f"tp={tp} does not divide {label}'s {n} {what}; expected one "
                             f"of {ok}")


@dataclass(frozen=True)
class ParallelDims:
    """Ranks per axis; validated at construction."""

    world: int
    """Every rank of the run (the planner's ``gpus``)."""
    tp: int = 1
    """Tensor-parallel degree: ranks that split each layer's matrices between them."""
    shard: int | None = None
    """K, the ranks a stage shards over (hybrid sharding's shard group); None: all
    ``dp`` data-parallel ranks."""
    secondary: int | None = None
    """K2, hpZ's secondary group inside the shard group; None (or K2 = K): none."""

    def __post_init__(self) -> None:
        _positive("world", self.world)
        _positive("tp", self.tp)
        if self.world % self.tp:
            raise ValueError(f"tp={self.tp} does not divide the {self.world} ranks; expected "
                             f"one of {_divisors(self.world)}")
        dp = self.world // self.tp
        k = dp if self.shard is None else self.shard
        if self.shard is not None:
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(f"shard_group={k!r}; expected None, an integer >= 1 "
                                 "dividing the data-parallel ranks, 'node' or a DeviceMesh "
                                 "with dims ('replicate', 'shard')")
            if dp % k:
                raise ValueError(f"shard_group={k} gives shard groups of {k} ranks, which do "
                                 f"not divide the {dp} data-parallel ranks; expected one of "
                                 f"{_divisors(dp)}, 'node' (ranks per machine) or None (all)")
        k2 = self.secondary
        if k2 is not None:
            if isinstance(k2, bool) or not isinstance(k2, int) or k2 < 1:
                raise ValueError(f"secondary_group={k2!r}; expected None or an integer >= 1 "
                                 "dividing the shard group")
            if k % k2:
                raise ValueError(f"secondary_group={k2} does not divide the shard group's "
                                 f"{k} ranks; expected one of {_divisors(k)}")

    @property
    def dp(self) -> int:
        """Data-parallel ranks: ``world / tp``."""
        return self.world // self.tp

    @property
    def shard_size(self) -> int:
        """K: the ranks each category the stage shards is cut over."""
        return self.dp if self.shard is None else self.shard

    @property
    def replicas(self) -> int:
        """R = dp / K: shard groups holding copies of one another (1 without hybrid)."""
        return self.dp // self.shard_size

    @property
    def secondary_size(self) -> int | None:
        """K2 of hpZ, or None where there is no secondary group (none asked, or K2 = K)."""
        k2 = self.secondary
        return None if k2 is None or k2 == self.shard_size else k2
