"""The process groups of a sharded model, made in one place: the data-parallel, shard,
replica, reduction, hpZ and control groups from ``spec/dims.py``'s sizes, the user's
tensor-parallel ``DeviceMesh`` read into them, and the mesh ``zeroshard train --tp``
builds.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..spec.dims import ParallelDims
from .dist import default_device

# ----------------------------------------------------------------------------------------
# The process groups a sharded model uses, made once at ``zs.shard`` time and owned by
# one :class:`Mesh`: its axes' sizes come from ``spec/dims.py`` ([Note: dims]).
#
# [Note: hybrid sharding] The data-parallel group of N ranks is split into R = N / K
# *shard groups* of K consecutive ranks (a node, or a few), across which the stage's
# categories are sharded, and K *replica groups* of R ranks (the ranks holding the same
# shard in every shard group), across which the shards are replicated (the source
# documents' hybrid sharding; FSDP2's HSDP over a ("replicate", "shard") mesh, DeepSpeed's
# MiCS). Gathers and reduce-scatters stay inside a shard group, on the fast links; only
# the reduced gradient shard, 1/K of the gradients, crosses between groups, in one
# all-reduce over the replica group. K = N is plain ZeRO (no replica groups); K = 1 is
# DDP with the stage's bookkeeping.
#
# Besides these, the engine makes a twin of the shard group for gradient reductions (so
# a rank whose reductions start late cannot pair them with another rank's gathers) and a
# gloo twin of the data-parallel group for fingerprints and agreements (``watch.py``).
#
# [Note: device mesh] To torch the same layout is a ``DeviceMesh`` (:attr:`Mesh.device_mesh`),
# made from these groups, not new ones (``DeviceMesh.from_group``): a 1-D mesh named
# ``("shard",)`` over the shard group, or under hybrid sharding the 2-D
# ``("replicate", "shard")`` mesh of FSDP2's HSDP, rows the shard groups. A shard is then
# exactly a DTensor ``Shard(0)`` on the ``"shard"`` dim (``unit.py``), which is
# what lets ``torch.distributed.checkpoint`` and FSDP2 read and reshard its state dicts.
#
# [Note: tensor-parallel mesh] Beside tensor parallelism (``zs.shard(..., mesh=)``) the
# user's ``DeviceMesh`` is the layout: ``("dp", "tp")``, or ``("dp_replicate", "dp_shard",
# "tp")`` for hybrid sharding (torchtitan's names). torch's ``parallelize_module`` put the
# model's DTensors on its ``"tp"`` dim; the data-parallel group is the ranks of this
# rank's tp coordinate (the ``"dp"`` dim, or ``dp_replicate × dp_shard`` flattened, K
# = ``dp_shard``'s size), over which ZeRO shards each rank's local slice ([Note:
# tensor-parallel parameters] in ``unit.py``). The tp group is the mesh's own, for
# counting the tensor-parallel collectives DTensor issues (``collectives.py``) and for
# what must hold across the tp ranks: the global norm, the non-finite verdict. The
# control group then spans every rank of the mesh, so the fingerprints and agreements
# (``watch.py``) stop all tp ranks alike, and :attr:`Mesh.device_mesh` is the user's
# mesh, on which a parameter's rows are a DTensor with a placement per dim.
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Mesh:
    """One owner of a sharded model's process groups: every group, rank and size of
    every axis, built once from the data-parallel group and the config; the collectives,
    clipping, the non-finite check and checkpoints ask it (torchtitan's ``ParallelDims``
    with its meshes; picotron's process-group manager)."""

    dims: ParallelDims
    """The axes' sizes (``spec/dims.py``): dp, shard group K, replicas R, hpZ's K2."""
    dp_group: object
    """The data-parallel group (None: the world)."""
    dp_rank: int
    dp_world: int
    shard_group: object
    """The K ranks the stage shards over (the data-parallel group when K = N)."""
    shard_rank: int
    shard_world: int
    replica_group: object
    """The R ranks holding this rank's shard in the other shard groups (None if R = 1)."""
    replica_rank: int
    replica_world: int
    reduce_group: object
    """A twin of ``shard_group`` for gradient reductions only."""
    secondary_group: object
    """hpZ: the K2 consecutive ranks of the shard group that hold a unit's weights
    between its forward and its backward (None without hpZ)."""
    secondary_rank: int
    secondary_world: int
    """K2, or 0 without hpZ."""
    control_group: object
    """A host-side (gloo) twin of ``dp_group`` for fingerprints and agreements."""
    global_ranks: tuple[int, ...]
    """The world ranks of the data-parallel group, in its order."""
    global_rank: int
    group_name: str
    """torch's name of the data-parallel group (keys in the rendezvous store)."""
    timeout_s: float | None
    """The data-parallel group's timeout (None: torch's default)."""
    gloo: bool
    """The data-parallel group runs on gloo (the engine's in-place collectives)."""
    tp_group: object = None
    """The tensor-parallel group (None without tensor parallelism)."""
    tp_rank: int = 0
    tp_world: int = 1
    control_world: int = 0
    """Ranks of ``control_group``: the data-parallel ranks, or every rank of the mesh
    with tensor parallelism ([Note: tensor-parallel mesh])."""
    user_mesh: object = None
    """The ``DeviceMesh`` given to ``zs.shard(..., mesh=)`` (None: none was)."""

    @classmethod
    def build(cls, group, shard_group=None, secondary_group=None, mesh=None) -> Mesh:
        """Every group of a model sharded over ``group`` as ``ZeroConfig.shard_group`` and
        ``secondary_group`` ask, or over the data-parallel dims of ``mesh`` ([Note:
        tensor-parallel mesh]). A collective of the whole world: every rank creates every
        group, in one order."""
        tp = {}
        if mesh is not None:
            group, shard_group, tp = from_device_mesh(mesh, group, shard_group)
        dp_world = dist.get_world_size(group)
        tp_world = tp.get("tp_world", 1)
        dims = ParallelDims(dp_world * tp_world, tp_world,
                            shard=shard_size(shard_group, dp_world), secondary=secondary_group)
        everyone = tuple(mesh.mesh.flatten().tolist()) if tp_world > 1 else None
        g = _make_groups(group, dims.shard_size, dims.secondary_size, everyone)
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        timeout = timeout_of(group)
        return cls(dims=dims, **g, **tp, user_mesh=mesh, global_rank=dist.get_rank(),
                   global_ranks=tuple(dist.get_process_group_ranks(group) if group is not None
                                      else range(dp_world)),
                   group_name=dist.distributed_c10d._get_process_group_name(pg),
                   timeout_s=timeout.total_seconds() if timeout is not None else None,
                   gloo="gloo" in str(dist.get_backend(group)))

    @functools.cached_property
    def device_mesh(self):
        """The shard group as torch's ``DeviceMesh`` ([Note: device mesh]), made once on
        first use from the existing groups (no collective, no new group)."""
        from torch.distributed.device_mesh import DeviceMesh

        if self.user_mesh is not None:
            return self.user_mesh
        device = default_device().type
        shard = self.shard_group
        if shard is None:  # the world
            shard = dist.distributed_c10d._get_default_group()
        if self.replica_world == 1:
            return DeviceMesh.from_group(shard, device, mesh_dim_names=("shard",))
        layout = torch.tensor(self.global_ranks).view(self.replica_world, self.shard_world)
        return DeviceMesh.from_group([self.replica_group, shard], device, mesh=layout,
                                     mesh_dim_names=("replicate", "shard"))


def node_ranks(dp_world: int, tp: int = 1) -> int:
    """The data-parallel ranks of one machine: ``shard_group="node"`` resolved, here only
    (the launcher's ``LOCAL_WORLD_SIZE`` ranks per node, over tensor parallelism's tp)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", dp_world * tp)) // tp


def shard_size(spec, dp_world: int) -> int | None:
    """K for ``ZeroConfig.shard_group`` at ``dp_world`` ranks: "node" is the ranks per
    machine, a DeviceMesh its "shard" dim; ``ParallelDims`` checks that K divides N."""
    if spec == "node":
        return node_ranks(dp_world)
    if _is_mesh(spec):
        names = tuple(spec.mesh_dim_names or ())
        if names != ("replicate", "shard"):
            raise ValueError(f"shard_group: a DeviceMesh with dims {names}; expected dims "
                             "('replicate', 'shard')")
        if spec.mesh.flatten().tolist() != list(range(dp_world)) or spec.size() != dp_world:
            raise ValueError("shard_group: the mesh must lay the data-parallel ranks out in "
                             "order, shard groups of consecutive ranks (init_device_mesh's "
                             f"layout); got {spec.mesh.tolist()}")
        return spec.size(1)
    return spec


def _make_groups(group, k: int, k2: int | None, everyone: tuple | None = None) -> dict:
    """The groups of shard groups of ``k`` (and, with hpZ, secondary groups of ``k2``
    inside each), with this rank's coordinates in each, as :class:`Mesh`'s fields;
    ``everyone``: the ranks the control group spans, when not the data-parallel ones."""
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
    control = everyone or tuple(ranks)
    wanted += [("reduce", s) for s in shards] + ([("control", control)] if host else [])
    seconds = [s[j:j + k2] for s in shards for j in range(0, k, k2)] if k2 else []
    wanted += [("secondary", s) for s in seconds if len(s) < dp_world]
    mine_second = next((s for s in seconds if ranks[dp_rank] in s), None)
    made = _create_everywhere(wanted, timeout, full=len(ranks) == world)
    return dict(
        dp_group=group, dp_rank=dp_rank, dp_world=dp_world,
        shard_group=made[("shard", mine_shard)] if r > 1 else group,
        shard_rank=dp_rank % k, shard_world=k,
        replica_group=made[("replica", tuple(ranks[dp_rank % k::k]))] if r > 1 else None,
        replica_rank=dp_rank // k, replica_world=r,
        reduce_group=made[("reduce", mine_shard)],
        secondary_group=(None if mine_second is None else group
                         if len(mine_second) == dp_world else made[("secondary", mine_second)]),
        secondary_rank=dp_rank % k2 if k2 else 0, secondary_world=k2 or 0,
        control_group=made[("control", control)] if host else group,
        control_world=len(control) if host else dp_world)


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


# ----------------------------------------------------------------------------------------
# The user's ``DeviceMesh`` read into the groups :class:`~zeroshard.runtime.mesh.Mesh`
# is built from ([Note: tensor-parallel mesh] in ``mesh.py``), checked once with one line
# per mistake.
# ----------------------------------------------------------------------------------------

#: The dims ``zs.shard(..., mesh=)`` takes, torchtitan's names (``ParallelDims`` in
#: ``torchtitan/distributed/parallel_dims.py``): plain ZeRO beside tensor parallelism, and
#: hybrid sharding beside it.
MESH_DIMS = (("dp", "tp"), ("dp_replicate", "dp_shard", "tp"))


def check_mesh(mesh) -> tuple[str, ...]:
    """The mesh's dim names, once checked: one of :data:`MESH_DIMS`, over every rank."""
    if type(mesh).__name__ != "DeviceMesh":
        raise ValueError(f"mesh={type(mesh).__name__}; expected a torch DeviceMesh with dims "
                         f"{' or '.join(map(str, MESH_DIMS))}")
    names = tuple(mesh.mesh_dim_names or ())
    if names not in MESH_DIMS:
        raise ValueError(f"mesh: a DeviceMesh with dims {names}; expected dims "
                         f"{' or '.join(map(str, MESH_DIMS))} (init_device_mesh(..., "
                         "mesh_dim_names=...))")
    if mesh.size() != dist.get_world_size():
        raise ValueError(f"mesh: a DeviceMesh of {mesh.size()} ranks in a world of "
                         f"{dist.get_world_size()}; expected one over every rank")
    return names


def from_device_mesh(mesh, group, shard_group) -> tuple[object, object, dict]:
    """(data-parallel group, shard group spec for ``ZeroConfig.shard_group``, the tp
    fields of :class:`Mesh`) of ``mesh``. The data-parallel group of the 3-D mesh, the
    ranks of this rank's tp coordinate in (replicate, shard) order, is made on every rank
    for every coordinate (torch names a group by creation order)."""
    names = check_mesh(mesh)
    if group is not None:
        raise ValueError("zs.shard(): group= and mesh= both given; the mesh's data-parallel "
                         "dims are the group: give one of them")
    tp_group = mesh.get_group("tp")
    tp_rank, tp_world = mesh.get_local_rank("tp"), mesh.size(names.index("tp"))
    if names == ("dp", "tp"):
        if shard_group is not None:
            raise ValueError(f"shard_group={shard_group!r} with a ('dp', 'tp') mesh; for "
                             "hybrid sharding beside tensor parallelism give a mesh with dims "
                             "('dp_replicate', 'dp_shard', 'tp')")
        dp_group = mesh.get_group("dp") if mesh.size(0) > 1 or tp_world > 1 else None
        k = None
    else:
        k = mesh.size(1)
        if shard_group not in (None, k, "node"):
            raise ValueError(f"shard_group={shard_group!r} and a mesh whose dp_shard dim has "
                             f"{k} ranks; give shard_group=None (the mesh's)")
        dp_group = None
        columns = mesh.mesh.reshape(-1, tp_world).t().tolist()  # one list per tp coordinate
        for column in columns:
            made = dist.new_group(column) if len(column) < dist.get_world_size() else None
            if dist.get_rank() in column:
                dp_group = made
    if tp_world == 1 and dp_group is not None and dist.get_world_size(dp_group) == \
            dist.get_world_size():
        dp_group = None  # the world: the engine's usual groups
    return dp_group, k, dict(tp_group=tp_group if tp_world > 1 else None, tp_rank=tp_rank,
                             tp_world=tp_world)


def check_tp_params(module, mesh) -> None:
    """Every DTensor parameter must sit on ``mesh``'s ``"tp"`` dim, placed as torch's
    tensor-parallel styles place them (``Shard`` or ``Replicate``), and split evenly:
    ZeRO shards each rank's local slice, and the ranks of a tp group must hold slices of
    one size for their collectives to pair up."""
    from torch.distributed.tensor import DTensor

    tp_mesh = None if mesh is None else mesh["tp"]
    for name, p in module.named_parameters():
        if not isinstance(p, DTensor):
            continue
        where = f"parameter {name!r} is a DTensor on a mesh of dims " \
                f"{tuple(p.device_mesh.mesh_dim_names or ())} ({p.device_mesh.mesh.tolist()})"
        if tp_mesh is None:
            raise ValueError(f"{where}, and zs.shard() was given no mesh; pass mesh= the "
                             "DeviceMesh whose 'tp' dim parallelize_module used")
        if (p.device_mesh.mesh.tolist() != tp_mesh.mesh.tolist()
                or tuple(p.device_mesh.mesh_dim_names or ()) != ("tp",)):
            raise ValueError(f"{where}, not on the 'tp' dim of the mesh zs.shard() was given "
                             f"({tp_mesh.mesh.tolist()}); parallelize with mesh['tp'] of that "
                             "mesh")
        placement = p.placements[0]
        if type(placement).__name__ not in ("Shard", "Replicate"):
            raise NotImplementedError(f"parameter {name!r} is placed {placement} on the tp "
                                      "dim; zeroshard shards Shard(d) and Replicate() "
                                      "tensor-parallel parameters (torch's parallel styles)")
        tp = tp_mesh.size()
        if placement.is_shard() and p.shape[placement.dim] % tp:
            raise ValueError(f"tp={tp} does not divide dim {placement.dim} of parameter "
                             f"{name!r} ({tuple(p.shape)}); expected a tp degree dividing "
                             f"{p.shape[placement.dim]}")


def tensor_parallel_mesh(tp: int, shard_group=None):
    """The ``DeviceMesh`` ``zeroshard train --tp`` gives ``zs.shard(..., mesh=)``: over every
    rank, tensor parallelism of degree ``tp`` on consecutive ranks (a node's), as
    ``("dp", "tp")``, or with a shard group of K data-parallel ranks (``"node"``: a
    node's ranks over tp) ``("dp_replicate", "dp_shard", "tp")``."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    device = default_device().type
    if world % tp:
        raise ValueError(f"--tp {tp} does not divide the {world} ranks; expected one of "
                         f"{[d for d in range(1, world + 1) if world % d == 0]}")
    dp = world // tp
    if shard_group is None:
        return init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
    k = node_ranks(dp, tp) if shard_group == "node" else shard_group
    if not isinstance(k, int) or k < 1 or dp % k:
        raise ValueError(f"shard_group={shard_group!r} with --tp {tp}: shard groups of {k} "
                         f"data-parallel ranks do not divide the {dp}; expected one of "
                         f"{[d for d in range(1, dp + 1) if dp % d == 0]}")
    return init_device_mesh(device, (dp // k, k, tp),
                            mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
