"""A unit's parameters as torch sees them: DTensors on the model's device mesh.

[Note: DTensor layout] Rank r of a shard group of K ranks holds rows [r·c, r·c + c) of a
parameter of d0 rows, c = ceil(d0 / K) (``layout.py``). That is exactly the local chunk
of a DTensor ``Shard(0)``: torch.chunk's split, whose last chunks may be short or empty
(d0 = 5 at K = 4: 2, 2, 1 and 0 rows; ``compute_local_shape_and_global_offset`` in
``torch/distributed/tensor/_utils.py``). So this rank's rows under the full shape *are*
a DTensor, with no copy and no collective:

- ``Shard(0)`` on the mesh's ``"shard"`` dim where the unit shards the parameter (stages
  1-3 for a trainable one, stage 3 for every one);
- ``Replicate()`` there where every rank holds it whole (stage 0, a frozen parameter
  below stage 3);
- ``Replicate()`` on hybrid sharding's ``"replicate"`` dim: the replica groups hold the
  same rows (``mesh.py``, [Note: hybrid sharding]).

Beside tensor parallelism the mesh is the user's (``("dp", "tp")`` or ``("dp_replicate",
"dp_shard", "tp")``; [Note: tensor-parallel mesh] in ``mesh.py``) and a parameter's
placements gain its tp placement last; the data-parallel placement then cuts its local
slice. Where tensor parallelism split dim 0 too (a column-parallel weight), rows of the
local slice are not rows of the full tensor in order: the tp rank's block is cut on the
dp dim, which DTensor writes ``_StridedShard(0, split_factor=tp)``, FSDP2's own placement
for the same layout (``_init_sharding_spec_tp`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``).

A 0-d parameter counts as one row of one, as in the layout: its DTensor has shape
``(1,)``, since a scalar cannot be chunked (``fully_shard`` refuses scalar parameters
and asks for exactly this shape). hpZ's secondary copies are transient, kept from a
forward for its backward, and never part of a state dict.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from .local import tp_dim, tp_placement
from .readout import held_rows


def rows_shape(shape) -> tuple[int, ...]:
    """The full shape a DTensor of a parameter of ``shape`` has: ``(1,)`` for a 0-d one."""
    return tuple(shape) if len(shape) else (1,)



def placements(unit, i: int) -> tuple:
    """Placements of parameter ``i``'s rows on ``unit.comm.mesh.device_mesh``."""
    mesh = unit.comm.mesh
    sharded = unit.world > 1 and (i in unit.trainable or unit.w_shard is not None)
    inner = Shard(0) if sharded else Replicate()
    if mesh.user_mesh is None:
        return (inner,) if mesh.replica_world == 1 else (Replicate(), inner)
    p = unit.params[i]
    if sharded and tp_dim(p) == 0 and mesh.tp_world > 1:
        inner = _StridedShard(0, split_factor=mesh.tp_world)
    dp = (inner,) if mesh.user_mesh.ndim == 2 else (Replicate(), inner)
    return (*dp, tp_placement(p))


def held(unit, i: int) -> tuple[torch.Tensor, int]:
    """The tensor this rank reads and writes parameter ``i`` through (the master rows,
    else the weights: ``readout.held_rows``), viewed as rows (at least 1-d), and the
    first full row it holds."""
    t, first = held_rows(unit, i)
    return (t.view(1) if t.dim() == 0 else t), first


def alias(t: torch.Tensor) -> torch.Tensor:
    """``t``, or where it does not start its storage, a tensor over the same memory that
    does. torch 2.13's DTensor takes its local tensor's storage offset (pytorch PR
    #167597), and ``torch.save`` then takes a DTensor over a view at an offset for a plain
    tensor and fails ("Attempted to access the data pointer on an invalid python
    storage"); the rows of a slot are such views. A slice of an untyped storage shares
    the memory (holding a reference to it) and starts at 0. Only for storages that are
    never resized: the master, the weight shard, optimizer state."""
    if t.storage_offset() == 0:
        return t
    item = t.element_size()
    start = t.storage_offset() * item
    storage = t.untyped_storage()[start:start + t.numel() * item]
    return t.new_empty(0).set_(storage, 0, t.shape, t.stride())


def to_dtensor(unit, i: int, local: torch.Tensor, trailing: tuple | None = None) -> DTensor:
    """``local`` (this rank's rows of parameter ``i``, or a per-element state of them)
    as a DTensor of the full shape, sharing its memory; ``trailing``: a state with one
    entry per row but another shape past dim 0 (Adafactor's row statistics), whose full
    shape is ``(d0, *trailing)``. Built as FSDP2 builds its sharded parameters
    (``_from_local_no_grad`` in ``fsdp/_fully_shard/_fsdp_common.py``): not
    differentiable, no check across ranks."""
    shape = torch.Size(rows_shape(unit.params[i].shape))
    if trailing is not None:
        shape = torch.Size((shape[0], *trailing))
    meta = TensorMeta(shape, _contiguous_stride(shape), local.dtype)
    spec = DTensorSpec(unit.comm.mesh.device_mesh, placements(unit, i), tensor_meta=meta)
    return DTensor(alias(local.detach()), spec, requires_grad=False)


def local_rows(unit, i: int, value, what: str, trailing: tuple | None = None) -> torch.Tensor:
    """``value`` as this rank's rows of parameter ``i``, shaped as :func:`held`'s tensor.
    Accepted: a DTensor of the full shape (its local tensor where it is laid out as
    ours, else gathered whole first: a collective over its mesh), the full tensor
    (or of shape ``(1,)`` for a 0-d parameter), or this rank's rows themselves.
    ``what`` names the value in the ValueError for any other shape; ``trailing``: as
    :func:`to_dtensor`'s, for a state with one entry per row."""
    target, first = held(unit, i)
    count = target.shape[0]
    full = tuple(unit.params[i].shape)
    if trailing is not None:
        full = (rows_shape(full)[0], *trailing)
        target = target.new_empty((count, *trailing))
    if isinstance(value, DTensor):
        if tuple(value.shape) not in (full, rows_shape(full)):
            raise ValueError(_shape_error(what, f"is a DTensor of shape {tuple(value.shape)}",
                                          full, target, first))
        if _same_layout(value, unit, i):
            return value.to_local().view(target.shape)
        value = value.full_tensor()
    value = torch.as_tensor(value)
    if tuple(value.shape) in (full, rows_shape(full)):
        value = tp_slice(unit, i, value.reshape(rows_shape(full)))
        return value[first:first + count]
    if value.shape == target.shape:
        return value
    raise ValueError(_shape_error(what, f"has shape {tuple(value.shape)}", full, target, first))


def tp_slice(unit, i: int, full: torch.Tensor) -> torch.Tensor:
    """This tp rank's slice of parameter ``i``'s full value (all of it where tensor
    parallelism does not split the parameter): DTensor's even split of its tp dim."""
    d, mesh = tp_dim(unit.params[i]), unit.comm.mesh
    return full if d is None else full.chunk(mesh.tp_world, dim=d)[mesh.tp_rank]


def _same_layout(value: DTensor, unit, i: int) -> bool:
    """Whether ``value``'s local tensor is this rank's rows: the same ranks in the same
    mesh layout and the same placements (the mesh object and its names may differ)."""
    mesh = unit.comm.mesh.device_mesh
    if tuple(value.placements) != placements(unit, i):
        return False
    return value.device_mesh is mesh or value.device_mesh.mesh.tolist() == mesh.mesh.tolist()


def _shape_error(what: str, got: str, full, target, first: int) -> str:
    return (f"{what} {got}; expected the full parameter {full} (a tensor or a DTensor) "
            f"or this rank's rows {tuple(target.shape)} (from row {first})")


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, out = 1, []
    for n in reversed(shape):
        out.append(stride)
        stride *= max(n, 1)
    return tuple(reversed(out))
