"""Bytes on the wire per GPU per step, by level (ring accounting; ZeRO paper, section 7).

An all-reduce of T bytes over n ranks sends 2(n-1)/n·T per rank, a reduce-scatter or
all-gather (n-1)/n·T. DDP all-reduces the gradients; ZeRO-1/2 reduce-scatter them and
all-gather the updated weights; ZeRO-3 gathers the weights twice (forward and
backward), 1.5× DDP's bytes when gradients and weights travel in one dtype.

Hybrid sharding (``shard_group`` K; FSDP2's HSDP, DeepSpeed's MiCS): stage k shards
over a group of K of the data-parallel ranks and replicates across the R = dp / K
groups, so memory is the plain figure at K ranks (floor 16P/K at stage 3). Bytes per
level (``comm_bytes_by_level``): *inside* a group the stage's collectives over K ranks;
*across* groups one all-reduce of what the group reduced, over R ranks — each rank's
reduced gradient shard, ``ring_all_reduce(r·P/K, R)`` (stage 0: the whole gradients,
``ring_all_reduce(r·P, R)``, after the all-reduce over K inside).

[Note: hybrid sharding] in ``runtime/groups.py`` is the engine's side; its ledger
(``comm_stats(by_level=True)``) records the same two levels, plus one presence flag per
parameter in each reduced slot, which the plan leaves out.
"""

from __future__ import annotations

from .recipes import Recipe


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def dp_degree(gpus: int, tp: int = 1) -> int:
    """Data-parallel ranks when ``gpus`` GPUs run tensor parallelism of degree ``tp``."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise ValueError(f"tp={tp!r} must be a positive integer")
    if gpus % tp:
        raise ValueError(f"gpus={gpus} is not divisible by tp={tp}")
    return gpus // tp


def shard_degree(gpus: int, tp: int = 1, shard_group: int | None = None) -> int:
    """K, the ranks a stage shards over: all ``gpus / tp`` data-parallel ranks, or with
    hybrid sharding a group of ``shard_group`` of them (R = dp / K replicas)."""
    dp = dp_degree(gpus, tp)
    k = shard_group
    if k is None:
        return dp
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(f"shard_group={k!r} must be a positive integer (None: all ranks)")
    if dp % k:
        ok = [d for d in range(1, dp + 1) if dp % d == 0]
        raise ValueError(f"shard_group={k} does not divide the {dp} data-parallel ranks; "
                         f"expected one of {ok}")
    return k


def ring_all_reduce(t: int, n: int) -> int:
    """Bytes one rank sends in a ring all-reduce of t bytes: 2(N-1)/N·t."""
    return _ceil_div(2 * (n - 1) * t, n)


def ring_one_way(t: int, n: int) -> int:
    """Bytes one rank sends in a ring reduce-scatter or all-gather of t bytes: (N-1)/N·t."""
    return _ceil_div((n - 1) * t, n)


def comm_bytes(params: int, gpus: int, recipe: Recipe, stage: int, tp: int = 1,
               shard_group: int | None = None) -> int:
    """Bytes one GPU sends per step under ring accounting (its 1/tp of the model, over
    the ``gpus / tp`` data-parallel ranks): both levels of :func:`comm_bytes_by_level`."""
    return sum(comm_bytes_by_level(params, gpus, recipe, stage, shard_group, tp).values())


def comm_bytes_by_level(params: int, gpus: int, recipe: Recipe, stage: int,
                        shard_group: int | None = None, tp: int = 1) -> dict[str, int]:
    """Bytes one GPU sends per step at each level, as the engine's ledger splits them
    (``comm_stats(by_level=True)``):

    - ``inside`` a shard group of K ranks: stage 0 all-reduces the gradients,
      ``2(K-1)/K·r·P``; stages 1-2 reduce-scatter them and all-gather the updated
      weights, ``(K-1)/K·(r + w)·P``; stage 3 gathers twice, ``(K-1)/K·(r + 2w)·P``;
    - ``across`` the R = dp / K groups: one all-reduce of each rank's reduced gradient
      shard over its R replicas, ``2(R-1)/R·r·P/K`` (stage 0: of the whole gradients,
      ``2(R-1)/R·r·P``); 0 when plain (K = dp, R = 1).

    r and w are the reduce and weight bytes per element; P is this GPU's 1/tp.
    """
    k = shard_degree(gpus, tp, shard_group)
    replicas = dp_degree(gpus, tp) // k
    grads = _ceil_div(recipe.reduce_bytes * params, tp)
    weights = _ceil_div(recipe.weight_bytes * params, tp)
    if stage == 0:
        return {"inside": ring_all_reduce(grads, k), "across": ring_all_reduce(grads, replicas)}
    gathers = 2 if stage == 3 else 1  # ZeRO-3 gathers for forward and again for backward
    return {"inside": ring_one_way(grads, k) + gathers * ring_one_way(weights, k),
            "across": ring_all_reduce(_ceil_div(grads, k), replicas)}
