"""The user's ``DeviceMesh`` read into the groups :class:`~zeroshard.runtime.mesh.Mesh`
is built from ([Note: tensor-parallel mesh] in ``mesh.py``), checked once with one line
per mistake."""

from __future__ import annotations

import torch.distributed as dist

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
