"""The process groups a sharded model uses, made once at ``zs.shard`` time.

[Note: hybrid sharding] The data-parallel group of N ranks is split into R = N / K
*shard groups* of K consecutive ranks (a node, or a few), across which the stage's
categories are sharded, and K *replica groups* of R ranks (the ranks holding the same
shard in every shard group), across which the shards are replicated (the source
documents' hybrid sharding; FSDP2's HSDP over a ("replicate", "shard") mesh, DeepSpeed's
MiCS). Gathers and reduce-scatters stay inside a shard group, on the fast links; only
the reduced gradient shard, 1/K of the gradients, crosses between groups, in one
all-reduce over the replica group. K = N is plain ZeRO (no replica groups); K = 1 is
DDP with the stage's bookkeeping.

Besides these, the engine makes a twin of the shard group for gradient reductions (so
a rank whose reductions start late cannot pair them with another rank's gathers) and a
gloo twin of the data-parallel group for fingerprints and agreements (``watch.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Groups:
    """A rank's groups and its coordinates in each."""

    dp: object
    """The data-parallel group (None: the world)."""
    dp_rank: int
    dp_world: int
    shard: object
    """The K ranks the stage shards over (the data-parallel group when K = N)."""
    shard_rank: int
    shard_world: int
    replica: object
    """The R ranks holding this rank's shard in the other shard groups (None if R = 1)."""
    replica_rank: int
    replica_world: int
    reduce: object
    """A twin of ``shard`` for gradient reductions only."""
    secondary: object
    """hpZ: the K2 consecutive ranks of the shard group that hold a unit's weights
    between its forward and its backward (None without hpZ)."""
    secondary_rank: int
    secondary_world: int
    control: object
    """A host-side (gloo) twin of ``dp`` for fingerprints and agreements."""


def secondary_size(k2, k: int) -> int | None:
    """K2 for ``ZeroConfig.secondary_group`` (hpZ), checked against the shard group."""
    if k2 is None or k2 == k:
        return None  # the secondary group would be the shard group: nothing to keep
    if k % k2:
        divisors = [d for d in range(1, k + 1) if k % d == 0]
        raise ValueError(f"secondary_group={k2} does not divide the shard group's {k} ranks; "
                         f"expected one of {divisors}")
    return k2


def shard_size(spec, dp_world: int) -> int:
    """K for ``ZeroConfig.shard_group`` at ``dp_world`` ranks, checked to divide it."""
    if spec is None:
        k = dp_world
    elif spec == "node":
        k = int(os.environ.get("LOCAL_WORLD_SIZE", dp_world))
    elif _is_mesh(spec):
        names = tuple(spec.mesh_dim_names or ())
        if names != ("replicate", "shard"):
            raise ValueError(f"shard_group: a DeviceMesh with dims {names}; expected dims "
                             "('replicate', 'shard')")
        k = spec.size(1)
        if spec.mesh.flatten().tolist() != list(range(dp_world)) or spec.size() != dp_world:
            raise ValueError("shard_group: the mesh must lay the data-parallel ranks out in "
                             "order, shard groups of consecutive ranks (init_device_mesh's "
                             f"layout); got {spec.mesh.tolist()}")
    else:
        k = spec
    if dp_world % k:
        divisors = [d for d in range(1, dp_world + 1) if dp_world % d == 0]
        raise ValueError(f"shard_group={spec!r} gives shard groups of {k} ranks, which do not "
                         f"divide the {dp_world} data-parallel ranks; expected one of "
                         f"{divisors}, 'node' (ranks per machine) or None (all)")
    return k


def make_groups(group, k: int, k2: int | None = None) -> Groups:
    """Every group of a model sharded over ``group`` in shard groups of ``k`` (and, with
    hpZ, secondary groups of ``k2`` inside each). A collective of the whole world: every
    rank creates every group, in one order."""
    world = dist.get_world_size()
    dp_rank, dp_world = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    timeout = timeout_of(group)  # torch gives a new group 30 minutes, not its parent's
    r = dp_world // k
    shards = [tuple(ranks[g * k:(g + 1) * k]) for g in range(r)]
    replicas = [tuple(ranks[s::k]) for s in range(k)] if r > 1 else []
    mine_shard = shards[dp_rank // k]
    backend = str(dist.get_backend(group))
    host = backend in ("gloo", "nccl")  # the fake test backend has no gloo beside it
    wanted = [("shard", s) for s in shards if r > 1] + [("replica", p) for p in replicas]
    wanted += [("reduce", s) for s in shards] + ([("control", tuple(ranks))] if host else [])
    seconds = [s[j:j + k2] for s in shards for j in range(0, k, k2)] if k2 else []
    wanted += [("secondary", s) for s in seconds if len(s) < dp_world]
    mine_second = next((s for s in seconds if ranks[dp_rank] in s), None)
    made = _create_everywhere(wanted, timeout, full=len(ranks) == world)
    return Groups(
        dp=group, dp_rank=dp_rank, dp_world=dp_world,
        shard=made[("shard", mine_shard)] if r > 1 else group,
        shard_rank=dp_rank % k, shard_world=k,
        replica=made[("replica", tuple(ranks[dp_rank % k::k]))] if r > 1 else None,
        replica_rank=dp_rank // k, replica_world=r,
        reduce=made[("reduce", mine_shard)],
        secondary=(None if mine_second is None else group if len(mine_second) == dp_world
                   else made[("secondary", mine_second)]),
        secondary_rank=dp_rank % k2 if k2 else 0, secondary_world=k2 or 0,
        control=made[("control", tuple(ranks))] if host else group)


def _create_everywhere(wanted: list[tuple[str, tuple]], timeout, full: bool) -> dict:
    """Create the groups ``wanted`` (role, ranks), and those every other rank wants, on
    every rank in one order: torch names a group by its creation order, so a group
    created by its members alone could get another name on each of them and never meet.
    Where the data-parallel group is the world every rank wants the same groups; else
    (data-parallel groups beside tensor parallelism, HSDP's replicas as separate
    models) the lists are exchanged first."""
    every = [wanted]
    if not full:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, wanted)
    made = {}
    for role, ranks in sorted({tuple(w) for lists in every for w in lists}):
        backend = "gloo" if role == "control" else None
        if len(ranks) == dist.get_world_size():  # the world, in world order
            group = dist.new_group(backend=backend, timeout=timeout)
        else:
            group = dist.new_group(list(ranks), backend=backend, timeout=timeout)
        made[(role, ranks)] = group
    return made


def timeout_of(group):
    """The timeout of ``group`` (the default group's when None), as its backend holds it;
    None (torch's default) where the backend does not say."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None


def _is_mesh(spec) -> bool:
    return type(spec).__name__ == "DeviceMesh"
