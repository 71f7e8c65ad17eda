"""A unit: the parameters gathered together and reduced together. Everything about
one unit lives here: the lifecycle of its full parameters, a parameter's local
tensor beside tensor parallelism, the dim-0 layout of its flat slots, its storages,
its parameters as DTensors, its gradient arithmetic, how far a backward is with it,
what the module shows under its names, the :class:`Unit` that owns its state, and
what the rest of the engine reads off it.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from ..spec.formulas import ceil_div, chunk_span, dim0_rows
from ..spec.policy import AfterStep, FullGrads, ShardPolicy
from .collectives import Collectives
from .dist import TORCH_DTYPES, host_device
from .events import Events
from .ledger import CATEGORIES, optimizer_state_bytes, tensor_bytes
from .offload import place_on_disk

# ----------------------------------------------------------------------------------------
# The lifecycle of a unit's full parameters, and what memory each state holds.
# ----------------------------------------------------------------------------------------

class UnitState(enum.Enum):
    """What a unit's full parameters hold."""

    SHARDED = "sharded"
    """Stage 3 between uses: full parameters have zero-size storage; only the slot of
    compute weights (1/N of the unit, padded) is held."""
    GATHERING = "gathering"
    """Stage 3: an all-gather is in flight (a prefetch); the full parameters are still
    empty, the gathered [N, S] buffer is allocated."""
    GATHERED = "gathered"
    """Full parameters allocated and filled: always below stage 3; at stage 3 from
    the unit's gather before forward (or backward) to its release after it."""


# ----------------------------------------------------------------------------------------
# A parameter's local tensor: the one helper every storage, shape and ``.grad`` access
# goes through, so a tensor-parallel parameter is handled exactly as a plain one.
#
# [Note: tensor-parallel parameters] After torch's ``parallelize_module`` a parameter is a
# DTensor ``nn.Parameter`` on the ``"tp"`` mesh: ``ColwiseParallel``'s weight is
# ``Shard(0)``, ``RowwiseParallel``'s ``Shard(1)``, its bias and ``SequenceParallel``'s norms
# ``Replicate()`` (``torch/distributed/tensor/parallel/style.py``). Autograd runs on the
# DTensor, while its values live in a plain *local tensor* (``_local_tensor``), this tp
# rank's slice. ZeRO shards that slice over the data-parallel ranks as it shards a plain
# parameter (FSDP2 does the same: ``_init_sharding_spec_tp`` in
# ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py`` returns
# ``param._local_tensor`` for chunking), so a unit's layouts are over local shapes, its
# storages hold local slices, and its reductions move local gradients. For a plain tensor
# every function here is the identity.
# ----------------------------------------------------------------------------------------

def is_dtensor(t) -> bool:
    return isinstance(t, DTensor)


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor holding ``t``'s values on this rank: a DTensor's local tensor, else
    ``t`` (None stays None)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def local_shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(local(p).shape)


def _spec(p: DTensor, dtype: torch.dtype) -> DTensorSpec:
    meta = TensorMeta(p.shape, p.stride(), dtype)
    return DTensorSpec(p.device_mesh, p.placements, tensor_meta=meta)


def repoint(p: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``view`` the storage of ``p``'s values (a plain parameter's data, or a
    DTensor's local tensor), ``p`` keeping its identity. A DTensor parameter is swapped
    whole (``torch.utils.swap_tensors``), as ``nn.Module._apply`` converts DTensor
    parameters, since its dtype may change (mixed precision's compute weights)."""
    if not isinstance(p, DTensor):
        p.data = view
        return
    new = nn.Parameter(DTensor(view, _spec(p, view.dtype), requires_grad=False),
                       requires_grad=p.requires_grad)
    torch.utils.swap_tensors(p, new)


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """``p.grad``'s local tensor. A DTensor gradient whose placements are not the
    parameter's is redistributed to them first and kept so: ``Partial()`` for a
    replicated norm under ``SequenceParallel`` (an all-reduce over the tp group, inside
    DTensor), ``Replicate()`` for a vocabulary-parallel embedding (torch's embedding
    backward gives the whole table; its slice is taken, no collective), as FSDP2 does in
    ``_get_grad_inner_tensor``. A gradient kept until the step (stage 1) is then this
    rank's slice, as the planner counts it."""
    g = p.grad
    if g is None or not isinstance(g, DTensor):
        return g
    if tuple(g.placements) != tuple(p.placements):
        p.grad = g = g.redistribute(p.device_mesh, p.placements)
    return g._local_tensor


def set_grad(p: torch.Tensor, g: torch.Tensor | None) -> None:
    """Set ``p.grad`` from a local tensor of its values (any shape of as many; None
    clears it): a DTensor parameter's gradient is a DTensor of its spec (autograd
    refuses any other)."""
    if g is not None:
        g = g.view(local(p).shape)
    if g is None or not isinstance(p, DTensor):
        p.grad = g
        return
    p.grad = DTensor(g, _spec(p, g.dtype), requires_grad=False)


def tp_placement(p: torch.Tensor):
    """The placement of ``p`` on the tp mesh dim: ``Replicate()`` for a plain tensor."""
    return p.placements[-1] if isinstance(p, DTensor) else Replicate()


def tp_dim(p: torch.Tensor) -> int | None:
    """The dim tensor parallelism splits ``p`` on, or None where every tp rank holds
    it whole (a plain tensor, a ``Replicate()`` DTensor)."""
    placement = tp_placement(p)
    return placement.dim if placement.is_shard() else None


# ----------------------------------------------------------------------------------------
# Shard layout of one unit: per-parameter dim-0 chunks packed into one flat slot.
#
# [Note: layout] Each parameter of d0 rows (0-d parameters count as one row of one) is
# cut on dim 0 into N chunks of c = ceil(d0/N) rows; rank r owns rows [r·c, r·c + c),
# of which ``real_rows(r)`` exist and the rest is padding. A rank's chunks of every
# parameter of the unit, in order, form its *slot* of S elements; all N slots side by
# side ([N, S], rank-major) are the all-gather output and the reduce-scatter input, so
# each pass moves one contiguous buffer per unit (the copy-in/copy-out scheme of FSDP2).
#
# Dim-0 chunks keep a parameter's trailing shape, so the optimizer's view of a shard is
# ``[real_rows, *shape[1:]]``: ``p.dim()`` stays meaningful for param groups written
# for the unsharded model, and elementwise optimizers update each element exactly as
# they would unsharded.
#
# A full parameter lives in a padded storage of N·c rows viewed as ``[N, c·row]``, so a
# gathered ``[N, S]`` buffer is copied out in one ``split_with_sizes_copy``.
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter sits in a unit's slot."""

    shape: tuple[int, ...]
    rows: int
    """d0: rows of the full parameter (1 for a 0-d parameter)."""
    row_numel: int
    """Elements per row: numel / rows."""
    chunk_rows: int
    """c = ceil(rows / N)."""
    offset: int
    """First element of this parameter's chunk within a slot."""

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @property
    def chunk_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    def real_rows(self, rank: int) -> int:
        """Rows of this parameter that rank owns (the rest of its chunk is padding)."""
        a, b = chunk_span(self.rows, rank, self.chunk_rows)
        return b - a

    def shard_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of rank's shard as the optimizer sees it: ``[real_rows, *shape[1:]]``."""
        return (self.real_rows(rank), *self.shape[1:]) if self.shape else (self.real_rows(rank),)


class ShardLayout:
    """The slot layout of a list of parameter shapes over ``world`` ranks."""

    def __init__(self, shapes: list[tuple[int, ...]], world: int):
        self.world = world
        self.slots: list[ParamSlot] = []
        offset = 0
        for shape in shapes:
            rows = shape[0] if shape else 1
            row_numel = math.prod(shape[1:]) if shape else 1
            c = ceil_div(rows, world)  # as in dim0_rows
            self.slots.append(ParamSlot(tuple(shape), rows, row_numel, c, offset))
            offset += c * row_numel
        self.slot_numel = offset
        """S: elements of one rank's slot, padding included."""

    @property
    def numel(self) -> int:
        """Real elements of the full parameters."""
        return sum(s.numel for s in self.slots)

    def real_numel(self, rank: int) -> int:
        """Real (non-padding) elements in rank's slot."""
        return sum(s.real_rows(rank) * s.row_numel for s in self.slots)

    @property
    def split_sizes(self) -> list[int]:
        return [s.chunk_numel for s in self.slots]

    def shard_views(self, flat: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """Views of a rank's flat slot ``[S]``, one per parameter, shaped as shards."""
        return [flat[s.offset:s.offset + s.real_rows(rank) * s.row_numel].view(s.shard_shape(rank))
                for s in self.slots]

    def padded_empty(self, slot: ParamSlot, dtype, device) -> torch.Tensor:
        """A full parameter in a padded storage of N·c rows, as ``[N, c·row]``."""
        return torch.empty(self.world, slot.chunk_numel, dtype=dtype, device=device)

    def pack(self, tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Copy full tensors (and any trailing [N, k] extras) into ``out`` as [N, S + k]:
        rank r's slot holds chunk r of each, zero-padded; casts to ``out``'s dtype."""
        torch._chunk_cat(tensors, 0, self.world, out=out.view(self.world, -1))
        return out

    def unpack_into(self, gathered: torch.Tensor, padded: list[torch.Tensor]) -> None:
        """Copy a gathered [N, S] buffer into full parameters' padded [N, c·row] storages."""
        torch.split_with_sizes_copy(gathered.view(self.world, -1), self.split_sizes, dim=1,
                                    out=padded)

    def unpack(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        """Full tensors (new storage) from a gathered [N, S] buffer."""
        g = gathered.view(self.world, -1)
        return [g[:, s.offset:s.offset + s.chunk_numel].reshape(-1)[:s.numel].view(s.shape)
                for s in self.slots]


# ----------------------------------------------------------------------------------------
# A unit's storages, made once from the model's parameters at ``zs.shard`` time.
#
# Parameter by parameter, so a rank holds the unit once plus one parameter: each is copied
# into a padded storage of N·c rows (``layout.py``), this rank's rows of it are copied
# into the fp32 master where there is one, and the original goes. A tensor-parallel
# parameter is its local slice here ([Note: tensor-parallel parameters] in ``local.py``). The
# :class:`~zeroshard.runtime.unit.Unit` keeps what this returns; nothing else
# writes these fields.
# ----------------------------------------------------------------------------------------

class Storages(NamedTuple):
    padded: list[torch.Tensor]
    """Each parameter's full storage, ``[world, c·row]``; the parameter is a view of it."""
    master: torch.Tensor | None
    """1D ``[S_g]``: this rank's slot of fp32 master weights (None without a master)."""
    w_shard: torch.Tensor | None
    """1D ``[S_w]``: this rank's slot of compute weights where parameters are sharded."""


def pinned() -> bool:
    """Host buffers are pinned where there is a device to copy to asynchronously."""
    return torch.cuda.is_available()


def make_storages(params: list[nn.Parameter], trainable: list[int], w_layout: ShardLayout,
                  g_layout: ShardLayout, rank: int, policy, compute_dtype, master_dtype,
                  device: torch.device, host: torch.device) -> Storages:
    """The padded full storages (each parameter re-pointed into its own), the master slot
    and, where the policy shards parameters, this rank's slot of compute weights."""
    world = w_layout.world
    padded = []
    master = None
    if master_dtype is not None:
        master = torch.zeros(g_layout.slot_numel, dtype=master_dtype,
                             device=host if policy.offloads_optimizer else device,
                             pin_memory=policy.where("optimizer") == "host" and pinned())
    g_slot = {i: g_layout.slots[j] for j, i in enumerate(trainable)}
    for i, (slot, p) in enumerate(zip(w_layout.slots, params)):
        src = local(p).detach().to(device).reshape(slot.rows, slot.row_numel)
        if (src.dtype == compute_dtype and src.is_contiguous()
                and src.storage_offset() == 0 and slot.chunk_rows * world == slot.rows
                and src.untyped_storage().nbytes() == slot.numel * src.element_size()
                and src.untyped_storage().resizable()):
            # no padding: keep the storage, under a tensor with its own version counter
            # (autograd must not see the optimizer's in-place updates as edits of p).
            # Not one that cannot be resized (weights memory-mapped from a file, as
            # transformers' from_pretrained leaves them): release() empties it.
            buf = torch.empty(0, dtype=src.dtype, device=device).set_(
                src.untyped_storage(), 0, (world, slot.chunk_numel))
        else:
            buf = w_layout.padded_empty(slot, compute_dtype, device)
            buf.view(-1)[:slot.numel].copy_(src.reshape(-1))
            buf.view(-1)[slot.numel:].zero_()
        flat = buf.view(-1)
        if master is not None and i in g_slot:
            gs, real = g_slot[i], g_slot[i].real_rows(rank)
            first = rank * gs.chunk_rows
            master[gs.offset:gs.offset + real * gs.row_numel].copy_(
                src[first:first + real].reshape(-1))
        repoint(p, flat[:slot.numel].view(slot.shape))
        padded.append(buf)
        del src
    w_shard = None
    if policy.shards_params:
        w_shard = torch.cat([buf[rank] for buf in padded])
        if policy.where("params") == "host":  # copied to the device by each gather
            w_shard = w_shard.to(host)
            if pinned():
                w_shard = w_shard.pin_memory()
    return Storages(padded, master, w_shard)


def optimizer_views(params: list[nn.Parameter], trainable: list[int], w_layout: ShardLayout,
                    g_layout: ShardLayout, rank: int, st: Storages) -> list[nn.Parameter]:
    """The parameters the optimizer sees: views of this rank's rows, shaped
    ``[real_rows, *shape[1:]]``, of the master (mixed precision) or of the compute
    weights themselves (fp32: the weights are the master)."""
    if st.w_shard is not None:
        views = w_layout.shard_views(st.w_shard, rank)
    else:
        views = [buf[rank][:s.real_rows(rank) * s.row_numel].view(s.shard_shape(rank))
                 for buf, s in zip(st.padded, w_layout.slots)]
    if st.master is not None:
        for j, view in enumerate(g_layout.shard_views(st.master, rank)):
            views[trainable[j]] = view
    return [nn.Parameter(v, requires_grad=p.requires_grad) for v, p in zip(views, params)]


# ----------------------------------------------------------------------------------------
# A unit's parameters as torch sees them: DTensors on the model's device mesh.
#
# [Note: DTensor layout] Rank r of a shard group of K ranks holds rows [r·c, r·c + c) of a
# parameter of d0 rows, c = ceil(d0 / K) (``layout.py``). That is exactly the local chunk
# of a DTensor ``Shard(0)``: torch.chunk's split, whose last chunks may be short or empty
# (d0 = 5 at K = 4: 2, 2, 1 and 0 rows; ``compute_local_shape_and_global_offset`` in
# ``torch/distributed/tensor/_utils.py``). So this rank's rows under the full shape *are*
# a DTensor, with no copy and no collective:
#
# - ``Shard(0)`` on the mesh's ``"shard"`` dim where the unit shards the parameter (stages
#   1-3 for a trainable one, stage 3 for every one);
# - ``Replicate()`` there where every rank holds it whole (stage 0, a frozen parameter
#   below stage 3);
# - ``Replicate()`` on hybrid sharding's ``"replicate"`` dim: the replica groups hold the
#   same rows (``mesh.py``, [Note: hybrid sharding]).
#
# Beside tensor parallelism the mesh is the user's (``("dp", "tp")`` or ``("dp_replicate",
# "dp_shard", "tp")``; [Note: tensor-parallel mesh] in ``mesh.py``) and a parameter's
# placements gain its tp placement last; the data-parallel placement then cuts its local
# slice. Where tensor parallelism split dim 0 too (a column-parallel weight), rows of the
# local slice are not rows of the full tensor in order: the tp rank's block is cut on the
# dp dim, which DTensor writes ``_StridedShard(0, split_factor=tp)``, FSDP2's own placement
# for the same layout (``_init_sharding_spec_tp`` in
# ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``).
#
# A 0-d parameter counts as one row of one, as in the layout: its DTensor has shape
# ``(1,)``, since a scalar cannot be chunked (``fully_shard`` refuses scalar parameters
# and asks for exactly this shape). hpZ's secondary copies are transient, kept from a
# forward for its backward, and never part of a state dict.
# ----------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------
# Gradient arithmetic of a unit that needs none of its state: kept apart so that
# ``unit.py`` holds the unit's fields and the methods that change them.
# ----------------------------------------------------------------------------------------

def averaged_grads(summed: torch.Tensor, present: list[bool], r_layout: ShardLayout,
                   n: int, dtype: torch.dtype) -> list[torch.Tensor | None]:
    """Averaged full gradients (stage 0) from the summed [K, S] buffer (K slots of the
    shard group, summed over all N ranks): each divided by ``n``, flat, or None where no
    rank saw the parameter (``present[j]`` false).

    Each gradient gets a padded storage [K, c·row] (the weights' layout), so its column
    range of the buffer lands in one pass that divides, casts to the stored dtype and
    copies at once (the same quotient, rounded once, as dividing the buffer first). The
    local gradients were freed when the reduction was issued, so these allocations
    replace them rather than add to them. A parameter no rank saw keeps no gradient: a
    zero one would count as seen in the next backward of the cycle and be stepped with
    weight decay (reading the flags is a host synchronisation the maths needs)."""
    out: list[torch.Tensor | None] = []
    k = summed.shape[0]
    for slot, seen in zip(r_layout.slots, present):
        if not seen:
            out.append(None)
            continue
        buf = torch.empty(k, slot.chunk_numel, dtype=dtype, device=summed.device)  # padded
        torch.div(summed[:, slot.offset:slot.offset + slot.chunk_numel], n, out=buf)
        out.append(buf.view(-1)[:slot.numel])
    return out


# ----------------------------------------------------------------------------------------
# How far one backward pass is with one unit: what still reads its full weights.
#
# [Note: partly frozen units] A unit's full weights are read in backward by every node
# that computes a gradient through them: of its trainable parameters, and of its inputs.
# When every parameter of a unit is trainable, the post-accumulate-grad hook of its last
# parameter comes after all of them (each node that reads a weight also produces that
# weight's gradient). A frozen weight breaks this: LoRA's base ``k_proj`` has no
# gradient of its own, yet its input gradient is computed from it, possibly after the
# adapters' last gradient has arrived — releasing the unit then leaves the node an
# emptied storage ("setStorage ... out of bounds for storage of size 0"). So a unit with
# frozen parameters also counts its forward calls whose inputs need a gradient, and each
# such call's input gradients as they are computed (an identity autograd function on the
# inputs, FSDP2's ``RegisterPostBackwardFunction`` in
# ``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``); its weights are released when
# both are complete. A call whose inputs need no gradient (the first block under frozen
# embeddings) reads no weight in backward but for its trainable parameters' gradients.
# A unit whose module calls other units (the root: final norm, head and embeddings around
# the blocks) is read on the way to their gradients, not its inputs': with frozen
# parameters it is held until backward ends (peft's ``modules_to_save`` head trains there
# beside a frozen norm).
# ----------------------------------------------------------------------------------------

class BackwardProgress:
    """Counts of one unit in the current backward (its fields change only here)."""

    def __init__(self, trainable: int) -> None:
        self.trainable = trainable
        self.grads = 0
        """Trainable parameters yet to accumulate their gradient in this backward."""
        self.calls = 0
        """Forward calls since the last backward whose inputs need a gradient."""
        self.inputs_done = 0
        """Of those calls, the ones whose input gradients this backward has computed."""
        self._counted = False  # a backward began since ``calls`` was counted
        self.to_the_end = False
        """Released only when backward ends (a unit with frozen parameters whose module
        calls other units)."""

    def hold_to_the_end(self) -> None:
        self.to_the_end = True

    def forward_call(self) -> None:
        """A forward call whose inputs need a gradient (counted afresh after a
        backward: the next backward runs the graph of the forwards since)."""
        if self._counted:
            self.calls, self._counted = 0, False
        self.calls += 1

    def start(self) -> None:
        """A backward begins (again over the same graph, under ``retain_graph``)."""
        self.grads, self.inputs_done, self._counted = self.trainable, 0, True

    def grad_arrived(self) -> bool:
        """A trainable parameter has its gradient; True when it was the last."""
        self.grads -= 1
        return self.grads == 0

    def input_done(self) -> None:
        self.inputs_done += 1

    @property
    def finished(self) -> bool:
        """Nothing of this backward reads the unit's full weights any more."""
        return not self.to_the_end and self.grads <= 0 and self.inputs_done >= self.calls


# ----------------------------------------------------------------------------------------
# What the module the user holds shows under a unit's parameter names.
#
# [Note: module view] At stage 3 a released unit's full parameters keep an empty storage:
# autograd's saved references to them must stay valid, so the storage object stays and
# the next gather refills it (``unit.py``). A tensor over an empty storage has a null
# data pointer, and reading one's values kills the process. So the module must not show
# them then: as FSDP2 registers its sharded DTensor parameters on the module at reshard
# and the unsharded ones at unshard (``FSDPParam.to_sharded`` / ``to_unsharded`` and
# ``_setattr_on_modules`` in ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``), a
# unit whose parameters are released shows, under each name that registers one, this
# rank's rows of the compute weights as a ``Shard(0)`` DTensor parameter of the full shape
# (``dtensor.py``), and its full parameters from its gather to its release. Whatever walks
# the module between forwards (``state_dict()``, ``named_parameters()``, ``save_pretrained``)
# then reads this rank's values, or the full ones through ``p.full_tensor()`` (a
# collective), never an empty tensor.
#
# The DTensors are views of the weight shard, made once; a swap is one dict write per
# registration, as FSDP2's ``unsafe_setattr_param``. Nothing is allocated or copied, so
# the engine's memory and speed are unchanged. Units whose parameters stay whole (stages
# 0-2, the persistent unit of stage 3) always show the full parameters.
# ----------------------------------------------------------------------------------------

class ModuleView:
    """The registrations of one unit's parameters on the module, and what they show."""

    def __init__(self, unit) -> None:
        index = {id(p): i for i, p in enumerate(unit.params)}
        self.places = [(m, name, index[id(p)], _plain(m)) for m in unit.module.modules()
                       for name, p in m._parameters.items() if p is not None and id(p) in index]
        """(module, attribute name, parameter index, whether the module keeps torch's own
        ``__setattr__``) of every registration (tied parameters have several)."""
        self.sharded: list[nn.Parameter] | None = None
        """What a released unit shows: its rows of each parameter, as DTensors."""
        if unit.w_shard is not None:
            rows = unit.w_layout.shard_views(unit.w_shard, unit.rank)
            self.sharded = [nn.Parameter(to_dtensor(unit, i, r), requires_grad=p.requires_grad)
                            for i, (r, p) in enumerate(zip(rows, unit.params))]

    def show(self, params: list[nn.Parameter]) -> None:
        """Register ``params[i]`` under every name of parameter i."""
        for module, name, i, plain in self.places:
            if plain:
                module._parameters[name] = params[i]  # FSDP2's fast path
            else:  # a module with its own __setattr__ sees the change
                setattr(module, name, params[i])



def _plain(module: nn.Module) -> bool:
    """Whether ``module`` sets attributes with ``nn.Module.__setattr__`` itself (FSDP2's
    ``unsafe_setattr_param`` asks the same)."""
    return getattr(module.__setattr__, "__func__", None) is nn.Module.__setattr__


# ----------------------------------------------------------------------------------------
# A unit: the parameters gathered together and reduced together.
#
# One code path for every stage; what differs is asked of the unit's ``ShardPolicy``
# (stage 0 is a shard group of one for the optimizer state). Every field is declared in
# :meth:`Unit.__init__` and changed only by the unit's own methods, which the reducer,
# the prefetcher, the step and the offload stream call (the rest is read through
# ``readout.py``); its collectives in flight are the comm context's (``schedule.py``).
# ----------------------------------------------------------------------------------------

class Unit:
    """Shards, gradients and collectives of one group of parameters."""

    def __init__(self, index: int, module: nn.Module, named_params: list[tuple[str, nn.Parameter]],
                 policy: ShardPolicy, recipe, comm: Collectives, ctx,
                 device: torch.device, events: Events, name: str = ""):
        # -- what the unit is (fixed) ----------------------------------------------------
        self.index, self.module, self.name = index, module, name
        self.policy, self.comm, self.ctx, self.events = policy, comm, ctx, events
        self.names, self.params = [n for n, _ in named_params], [p for _, p in named_params]
        self.trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        mesh = comm.mesh
        # rank and world of the optimizer state's shard group (a group of one at stage 0)
        self.rank, self.world = policy.shard_coords(mesh.shard_rank, mesh.shard_world)
        # over local shapes ([Note: tensor-parallel parameters] in local.py)
        self.w_layout = ShardLayout([local_shape(p) for p in self.params], self.world)
        self.g_layout = ShardLayout([local_shape(self.params[i]) for i in self.trainable],
                                    self.world)
        # Gradients always travel in the K-slot layout of the shard group, stage 0
        # included: on gloo a reduce-scatter is an all-reduce of its input, so stage 0's
        # all-reduce sums every element in the same order: bit for bit as stages 1-3.
        self.r_layout = ShardLayout([s.shape for s in self.g_layout.slots], mesh.shard_world)
        self.compute_dtype, self.grad_dtype = (TORCH_DTYPES[recipe.param_dtype],
                                               TORCH_DTYPES[recipe.grad_dtype])
        self.reduce_dtype = TORCH_DTYPES[recipe.reduce_dtype or recipe.grad_dtype]
        self.master_dtype = TORCH_DTYPES[recipe.master_dtype] if recipe.master_dtype else None
        if policy.offloads_optimizer and self.master_dtype is None:
            self.master_dtype = torch.float32  # fp32 offloaded: the host copy the step updates
        self.device, self.host = device, host_device()
        # -- storages (storage.py) -------------------------------------------------------
        st = make_storages(self.params, self.trainable, self.w_layout, self.g_layout, self.rank,
                           policy, self.compute_dtype, self.master_dtype, device, self.host)
        self.disk = None  # disk offload: the file of the master and moments (runtime/offload.py)
        if policy.optimizer_on_disk and st.master is not None:
            self.disk, master = place_on_disk(st.master, policy.offload_dir, comm, index)
            st = st._replace(master=master)
        self.padded = st.padded  # full parameters' storages, [world, c·row] each
        self.master = st.master  # 1D [S_g]: this rank's slot of fp32 master weights
        self.w_shard = st.w_shard  # 1D [S_w], stage 3: this rank's slot of compute weights
        self.shards = optimizer_views(self.params, self.trainable, self.w_layout,
                                      self.g_layout, self.rank, st)
        # -- the full weights' lifecycle (stage 3) ---------------------------------------
        self.state = UnitState.GATHERED
        self.prefetched = False  # gathered ahead of use, not used yet
        self.w_secondary = None  # hpZ: [K/K2, S] slots kept from forward for backward
        # -- this cycle's gradients ------------------------------------------------------
        self.progress = BackwardProgress(len(self.trainable))  # what still reads the weights
        self.ready = False  # this backward is done with the unit's parameters
        self.fresh = True  # the next reduced gradient overwrites the accumulator
        self.presence = None  # [F] per trainable param: ranks x micro-batches with a gradient
        # 1D [S_g]: this cycle's reduced gradients (accumulated over its backwards at
        # stages 2-3); made by the cycle's first reduction, dropped after the step
        self.grad_shard = None
        self.host_grads = None  # offload: the reduced slot copied to the host (master dtype)
        self.step_grads = None  # 1D fp32 gradients handed to the optimizer (transient)
        self.sync_whole = False  # the sync in flight brings this rank's rows too (cast)
        self.view = ModuleView(self)  # what the module shows ([Note: module view], view.py)
        self._owned_rows = None  # owned_rows(), made on first use
        if policy.shards_params:
            self.release()

    # -- sharded parameters (stage 3): gather and release ---------------------------
    def start_gather(self, prefetch: bool = False) -> None:
        """Issue the all-gather of the compute weights; ``prefetch``: ahead of use."""
        if self.state is not UnitState.SHARDED:
            return
        out = torch.empty(self.world, self.w_layout.slot_numel, dtype=self.compute_dtype,
                          device=self.device)
        if self.w_secondary is not None and torch._C._current_graph_task_id() != -1:
            # hpZ, in backward: inside the secondary group only (a forward always gathers the
            # shards: a secondary copy left by a forward no backward used is stale by then)
            work = self.comm.all_gather(out, self.w_secondary, async_op=True, unit=self.index,
                                        secondary=True)
        else:
            work = self.comm.all_gather(out, self.w_shard.to(self.device, non_blocking=True),
                                        async_op=True, unit=self.index, weights=True)
        self.ctx.issue("gather", self.index, work, out)
        self.state = UnitState.GATHERING
        self.prefetched = prefetch
        self.events.emit("gather_issued", self)

    def gather(self) -> None:
        """Finish (or issue and finish) the all-gather into the full parameters' storages."""
        self.prefetched = False  # in use now
        if self.state is UnitState.GATHERED:
            return
        self.start_gather()
        (out,) = self.ctx.land("gather", self.index)
        for p, buf in zip(self.params, self.padded):
            local(p).untyped_storage().resize_(buf.numel() * buf.element_size())
        self.w_layout.unpack_into(out, self.padded)
        self.view.show(self.params)
        self.state = UnitState.GATHERED
        self.events.emit("gather_done", self)

    def release(self, keep_secondary: bool = False) -> None:
        """Free the full parameters; autograd's saved references keep the (empty)
        storage object, which :meth:`gather` refills before backward needs it.

        hpZ, after a forward (``keep_secondary``): secondary rank j of K2 keeps the slots
        of shard ranks [j·m, (j+1)·m), m = K / K2 — the K2 ranks of its secondary group
        hold all K between them — so the backward's gather stays inside that group."""
        if self.state is UnitState.GATHERING:  # a prefetch nobody used: let it land
            self.gather()
        self.w_secondary = None
        mesh = self.comm.mesh
        if keep_secondary and mesh.secondary_world and self.state is UnitState.GATHERED:
            m = self.world // mesh.secondary_world
            j = mesh.secondary_rank
            self.w_secondary = torch.cat([buf[j * m:(j + 1) * m] for buf in self.padded],
                                         dim=1)  # [m, S], the gather's slot layout
        self.view.show(self.view.sharded)  # the module shows rows, not emptied storages
        for p in self.params:
            local(p).untyped_storage().resize_(0)
        self.state = UnitState.SHARDED
        self.events.emit("release", self)

    def full_bytes(self) -> int:
        """Bytes of the unit's full parameters when gathered (padding included), in the
        compute dtype: what a gather adds until its release."""
        return sum(b.numel() for b in self.padded) * self.compute_dtype.itemsize

    def drop_secondary(self) -> None:
        """hpZ: a unit the backward did not reach keeps no secondary copy past it."""
        self.w_secondary = None

    # -- gradients ------------------------------------------------------------------
    def start_backward(self, new_cycle: bool) -> None:
        self.progress.start()
        self.ready = False
        if new_cycle:
            self.fresh = True
            self.host_grads = None
            self.presence = None
            self.step_grads = None
            if self.policy.keeps_full_grads:  # the last cycle's, still held
                for i in self.trainable:
                    self.params[i].grad = None

    def grad_arrived(self) -> bool:
        """A trainable parameter has its gradient; True when it was the last."""
        return self.progress.grad_arrived()

    def inputs_done(self) -> None:
        """A forward call's input gradients are computed (``progress.py``)."""
        self.progress.input_done()
        if self.policy.shards_params and self.progress.finished:
            self.release()

    def backward_done(self) -> None:
        """Every gradient of the unit is in (or backward ended): release the weights
        where the policy shards them, unless an input gradient still reads them."""
        self.ready = True
        self.events.emit("backward_end", self)
        if self.policy.shards_params and self.progress.finished:
            self.release()

    def reduction_issued(self, work, buf: torch.Tensor, part: torch.Tensor) -> None:
        """This unit's gradients are packed into ``buf``; ``part`` of the result is its
        share. The local full gradients go now where the policy frees them."""
        self.ctx.issue("reduce", self.index, work, buf, part)
        if self.policy.frees_grads_when_packed:
            for i in self.trainable:
                self.params[i].grad = None
        self.events.emit("reduce_issued", self)

    def advance_reduce(self) -> None:
        """Hybrid sharding: land the reduction inside the shard group and issue the one
        across replica groups, not waiting for it (it overlaps what follows); the
        reduce-scatter's input buffer goes now. Otherwise, :meth:`wait_reduce`."""
        if not self.ctx.pending("reduce", self.index):
            return
        buffers = self.ctx.buffers(self.index)
        keep = buffers[-1:] if self.policy.reduce == "reduce_scatter" else buffers
        if not self.ctx.advance("reduce", self.index, *keep):
            self.wait_reduce()

    def wait_reduce(self) -> None:
        """Finish an issued reduction: average, then store where the stage keeps it."""
        landed = self.ctx.land("reduce", self.index)
        if landed is None:
            return
        out = landed[-1]
        self.events.emit("reduce_done", self)
        S = self.r_layout.slot_numel
        full = self.policy.full_grads
        if full is FullGrads.AVERAGED:  # [K, S + F]: every slot, averaged into full grads
            flags = out[0, S:]  # summed over every rank: > 0 where any rank saw it
            grads = averaged_grads(out[:, :S], (flags > 0).tolist(), self.r_layout,
                                   self.comm.mesh.dp_world, self.grad_dtype)
            for i, g in zip(self.trainable, grads):
                set_grad(self.params[i], g)
        else:  # [S + F]: this rank's slot, already averaged by the reduce-scatter
            flags, reduced = out[S:], out[:S]
            if full is FullGrads.LOCAL or self.fresh:
                # A view of the reduction's result when the dtypes agree (no copy, and no
                # shard of gradients held between steps), else rounded into the stored
                # dtype. Kept local sums are reduced again whole: the last counts.
                self.grad_shard = reduced.to(self.grad_dtype)
            else:  # summed in the reduce dtype, rounded once into the stored dtype
                self.grad_shard.add_(reduced)
            if self.policy.offloads_optimizer:  # to the host as it lands, during backward;
                # the cycle's last landing is the one the step uses
                self.host_grads = self.grad_shard.to(self.master.device, self.master_dtype,
                                                     non_blocking=True, copy=True)
        self.presence = flags.clone() if self.presence is None else self.presence + flags
        self.fresh = False

    # -- the step -------------------------------------------------------------------
    def assign_step_grads(self, present: list[bool]) -> None:
        """Hand the optimizer this rank's reduced gradients (fp32 for a master copy);
        ``present[j]``: some rank saw trainable parameter j this cycle."""
        if self.policy.full_grads is FullGrads.AVERAGED:
            for j, i in enumerate(self.trainable):
                g = local(self.params[i].grad)
                shard = self.shards[i]
                shard.grad = None if not present[j] or g is None else (
                    g.to(self.master_dtype) if self.master is not None else g).view(shard.shape)
            return
        flat = self.host_grads if self.host_grads is not None else self.grad_shard
        if self.master is not None and (flat.dtype != self.master_dtype
                                        or flat.device != self.master.device):
            flat = flat.to(self.master.device, self.master_dtype)  # offload: to the host
        self.step_grads = flat
        for j, view in enumerate(self.g_layout.shard_views(flat, self.rank)):
            self.shards[self.trainable[j]].grad = view if present[j] else None

    # -- what offload's streamed step reads (runtime/offload.py) -----------------------
    def owned_rows(self) -> list[tuple[nn.Parameter, int, int]]:
        """``(shard, offset, numel)`` per trainable parameter, in slot order: the optimizer's
        shard and where this rank's real rows of it sit in the unit's flat slot (the
        master's, the moments', disk offload's file's), padding left out."""
        rows = self._owned_rows
        if rows is None:
            rows = self._owned_rows = [
                (self.shards[i], s.offset, s.real_rows(self.rank) * s.row_numel)
                for i, s in zip(self.trainable, self.g_layout.slots)]
        return rows

    def slot_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` (1D [S_g]: a slot laid out as the master) cut into this rank's rows
        of each trainable parameter, each shaped as its shard."""
        return self.g_layout.shard_views(flat, self.rank)

    def compute_rows(self, j: int) -> torch.Tensor:
        """Flat: the compute weights this rank's rows of trainable parameter ``j`` are
        written to after a step (stage 3's weight shard, else the full weights' rows)."""
        i = self.trainable[j]
        if self.w_shard is not None:
            return self.w_layout.shard_views(self.w_shard, self.rank)[i].reshape(-1)
        slot = self.w_layout.slots[i]
        return self.padded[i][self.rank][:slot.real_rows(self.rank) * slot.row_numel]

    def drop_step_grads(self) -> None:
        """Free the fp32 copies for the optimizer: the cycle's next backward renews them."""
        if self.master is not None:
            for i in self.trainable:
                self.shards[i].grad = None
            self.step_grads = None

    def after_step(self, weights_updated: bool = False) -> None:
        """Let go of the cycle's gradients and bring the compute weights up to date with
        the updated shards; ``weights_updated``: the step wrote the update into the
        compute weights already (disk offload's streamed step), so nothing is cast."""
        self.step_grads = self.grad_shard = self.host_grads = None
        for i in self.trainable:
            # The step has consumed the full gradients: the next backward starts a new
            # cycle anyway, so they go now rather than live through the next forward
            # beside its activations. At stage 0 in fp32 the shard's .grad is a view of
            # them and holds them until the optimizer's zero_grad(), as torch DDP's do.
            if self.policy.keeps_full_grads:
                self.params[i].grad = None
            if self.master is not None:
                self.shards[i].grad = None  # fp32 copies: free them now
        self.refresh_compute(from_weights=weights_updated)

    def refresh_compute(self, from_weights: bool = False) -> None:
        """Bring the compute weights up to date with the (updated or loaded) shards:
        ``policy.after_step`` says how. ``from_weights``: this rank's rows of the compute
        weights are current already; only the other ranks' rows are wanted."""
        if not self.trainable:
            return
        if self.policy.after_step is AfterStep.CAST:
            if self.master is None or from_weights:
                return  # fp32: the shard is a view of the compute weights, updated in place
            if self.w_shard is not None:
                w_views = self.w_layout.shard_views(self.w_shard, self.rank)
                for i in self.trainable:  # cast on the host first: half the bytes to move
                    w_views[i].copy_(self.shards[i].detach().to(self.compute_dtype))
            else:
                for i in self.trainable:
                    w = local(self.params[i]).data
                    w.copy_(self.shards[i].detach().to(self.compute_dtype).view(w.shape))
            return
        # all-gather every rank's updated rows into every rank's full weights
        self.wait_sync()
        out = torch.empty(self.world, self.g_layout.slot_numel, dtype=self.compute_dtype,
                          device=self.device)
        inp = out[self.rank]  # in place: this rank's slot is the gather's input
        if self.master is not None and not from_weights:
            inp.copy_(self.master.to(self.compute_dtype))  # cast on the host first
        else:
            torch.cat([self.padded[i][self.rank] for i in self.trainable], out=inp)
        work = self.comm.all_gather(out, inp, async_op=True, unit=self.index)
        self.ctx.issue("sync", self.index, work, out, inp)
        self.sync_whole = self.master is not None and not from_weights

    def wait_sync(self) -> None:
        landed = self.ctx.land("sync", self.index)
        if landed is None:
            return
        out = landed[0]
        full = [self.padded[i] for i in self.trainable]  # [N, c·row] each
        if self.sync_whole:  # every rank's rows arrive cast from the master
            self.g_layout.unpack_into(out, full)
            return
        # Without a master the optimizer updated this rank's rows in place: land the
        # other ranks' rows only, (N-1)/N of the unit, in at most two copies.
        r = self.rank
        for rows in (slice(0, r), slice(r + 1, self.world)):
            if rows.start < rows.stop:
                torch.split_with_sizes_copy(out[rows], self.g_layout.split_sizes, dim=1,
                                            out=[t[rows] for t in full])


# ----------------------------------------------------------------------------------------
# What the rest of the engine reads off a unit, without changing it: the bytes it
# holds by ledger category (:func:`memory`, :func:`host_bytes`, :func:`disk_bytes`,
# :func:`buffers_in_flight`; :func:`measure` for a list of units), the rows this rank
# holds of each parameter (:func:`held_rows`, for state dicts and checkpoints), the
# gradient rows it counts in a global norm (:func:`norm_grads`, for clipping and the
# non-finite check), its local gradients packed for a reduction (:func:`local_grads`)
# and the full values (:func:`full_tensors`). The model's readout,
# clipping, checkpoints and the profiler read a unit through these alone.
# ----------------------------------------------------------------------------------------

def held_rows(unit, i: int) -> tuple[torch.Tensor, int]:
    """The tensor this rank reads and writes parameter ``i``'s values through, and the
    first full row it holds: the optimizer-facing shard (rows of the dim-0 chunk
    ``dim0_rows(rows, rank, world)``), or, for a frozen parameter kept whole, the
    compute weight itself from row 0. Rows of the local slice of a tensor-parallel
    parameter ([Note: tensor-parallel parameters] in ``local.py``)."""
    p = local(unit.params[i])
    if i in unit.trainable or unit.w_shard is not None:
        rows = p.shape[0] if p.dim() else 1
        return unit.shards[i], dim0_rows(rows, unit.rank, unit.world)[0]
    return p, 0


def norm_grads(unit) -> list[torch.Tensor]:
    """The part of each shard's gradient this rank counts in a global norm: its own
    rows, or where the shard is whole (stage 0) the rows it would own in its shard
    group, so every stage sums the same partial norms (summed over the shard group:
    the replica groups hold the same rows). Beside tensor parallelism, summed over the
    tp group too: a parameter every tp rank holds whole (a norm, a row-parallel bias)
    counts on tp rank 0 only."""
    out = []
    mesh = unit.comm.mesh
    for j, i in enumerate(unit.trainable):
        g = unit.shards[i].grad
        if g is None or (mesh.tp_rank and tp_dim(unit.params[i]) is None):
            continue
        if unit.world == 1 and unit.comm.mesh.shard_world > 1:
            rows = unit.g_layout.slots[j].rows
            a, b = dim0_rows(rows, unit.comm.mesh.shard_rank, unit.comm.mesh.shard_world)
            g = g.reshape(rows, -1)[a:b]
        out.append(g)
    return out


def local_grads(unit) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Full local gradients as [rows, row] views (zeros where none) and [F] flags."""
    grads, flags = [], []
    for j, i in enumerate(unit.trainable):
        g, slot = local_grad(unit.params[i]), unit.g_layout.slots[j]
        flags.append(g is not None)
        grads.append(torch.zeros(slot.rows, slot.row_numel, dtype=unit.grad_dtype,
                                 device=unit.device) if g is None
                     else g.reshape(slot.rows, slot.row_numel))
    return grads, torch.tensor(flags, dtype=unit.grad_dtype, device=unit.device)


def memory(unit, optimizer=None) -> dict[str, int]:
    """Bytes this unit holds on this rank by ledger category (``runtime/ledger.py``),
    read off the tensors themselves; communication buffers in flight are
    :func:`buffers_in_flight` (the units of a reduce bucket share one)."""
    pol, r, out = unit.policy, unit.rank, dict.fromkeys(CATEGORIES, 0)
    w_item = unit.compute_dtype.itemsize
    if pol.shards_params:  # the slot between uses; the full weights while gathered
        out["params"] += unit.w_layout.real_numel(r) * w_item
        out["padding"] += (unit.w_layout.slot_numel - unit.w_layout.real_numel(r)) * w_item
        if unit.state is UnitState.GATHERED:
            out["gathered"] += sum(tensor_bytes(b) for b in unit.padded)
        if unit.w_secondary is not None:  # hpZ: kept from forward for backward
            out["gathered"] += tensor_bytes(unit.w_secondary)
    else:  # full, in padded storages
        out["params"] += unit.w_layout.numel * w_item
        out["padding"] += sum(tensor_bytes(b) for b in unit.padded) - out["params"]
    g_real, g_slot = unit.g_layout.real_numel(r), unit.g_layout.slot_numel
    if pol.keeps_full_grads:
        averaged = pol.full_grads is FullGrads.AVERAGED
        for i in unit.trainable:
            g = local(unit.params[i].grad)
            if g is None and averaged and unit.master is None:
                g = unit.shards[i].grad  # after the step: a view of them, until zero_grad()
            if g is not None:
                out["grads"] += tensor_bytes(g)
                if averaged:  # landed in a padded [N, c·row] storage: the rest is padding
                    out["padding"] += g.untyped_storage().nbytes() - tensor_bytes(g)
        if unit.grad_shard is not None:  # stage 1's reduced slot, until the step
            out["buffers"] += tensor_bytes(unit.grad_shard)
    elif unit.grad_shard is not None:  # between a cycle's first reduction and its step
        out["grads"] += g_real * unit.grad_dtype.itemsize
        out["padding"] += (g_slot - g_real) * unit.grad_dtype.itemsize
    if unit.disk is not None:  # the file: master and both moments, padding included
        for c, b in disk_bytes(unit).items():
            out[c] += b
    elif unit.master is not None:
        out["optimizer"] += g_real * unit.master_dtype.itemsize
        out["padding"] += (g_slot - g_real) * unit.master_dtype.itemsize
        if not pol.shards_optimizer:  # fp32 copies of the full gradients for the step
            out["buffers"] += sum(tensor_bytes(unit.shards[i].grad) for i in unit.trainable
                                  if unit.shards[i].grad is not None)
    if unit.disk is None:
        out["optimizer"] += optimizer_state_bytes(optimizer, unit.shards)
    if unit.step_grads is not None and unit.step_grads is not unit.grad_shard:
        out["buffers"] += tensor_bytes(unit.step_grads)
    if unit.host_grads is not None and unit.host_grads is not unit.step_grads:
        out["buffers"] += tensor_bytes(unit.host_grads)  # offload: landed, not yet handed
    return out


def host_bytes(unit, optimizer=None) -> dict[str, int]:
    """The part of :func:`memory` that lives on the host (offload): the master, its
    padding and the optimizer state (in :func:`disk_bytes` instead with
    ``offload_dir``), the step's fp32 gradients, and with ``offload="params"`` the
    weight shard and its padding."""
    out = dict.fromkeys(CATEGORIES, 0)
    pol, r = unit.policy, unit.rank
    if pol.offloads_optimizer and unit.master is not None:
        g_real, g_slot = unit.g_layout.real_numel(r), unit.g_layout.slot_numel
        if unit.disk is None:
            out["optimizer"] += (g_real * unit.master_dtype.itemsize
                                 + optimizer_state_bytes(optimizer, unit.shards))
            out["padding"] += (g_slot - g_real) * unit.master_dtype.itemsize
        if unit.step_grads is not None and unit.step_grads is not unit.grad_shard:
            out["buffers"] += tensor_bytes(unit.step_grads)
        if unit.host_grads is not None and unit.host_grads is not unit.step_grads:
            out["buffers"] += tensor_bytes(unit.host_grads)
    if pol.shards_params and pol.where("params") == "host":
        w_item, w_real = unit.compute_dtype.itemsize, unit.w_layout.real_numel(r)
        out["params"] += w_real * w_item
        out["padding"] += (unit.w_layout.slot_numel - w_real) * w_item
    return out


def disk_bytes(unit) -> dict[str, int]:
    """The part of :func:`memory` in files (disk offload): the master and Adam's two
    moments, three fp32 planes of the slot, its padding included."""
    out = dict.fromkeys(CATEGORIES, 0)
    if unit.disk is not None:
        g_real = unit.g_layout.real_numel(unit.rank)
        out["optimizer"] = 3 * 4 * g_real
        out["padding"] = 3 * 4 * (unit.disk.numel - g_real)
    return out


def buffers_in_flight(unit) -> list[torch.Tensor]:
    """Communication buffers of this unit's collectives not yet landed."""
    return unit.ctx.buffers(unit.index)


def full_tensors(unit) -> dict[str, torch.Tensor]:
    """Full values under original names: the master where there is one (the source
    of truth), else the compute weights. A collective over the shard group. A
    tensor-parallel parameter's value is its local slice, whole over the shard group."""
    values = {}
    whole = unit.w_shard is None
    for i, p in enumerate(unit.params):
        if whole and (unit.master is None or i not in unit.trainable):
            values[unit.names[i]] = local(p).detach().clone()
    masters = [i for i in unit.trainable] if unit.master is not None else []
    if masters and unit.world == 1:
        for i in masters:
            values[unit.names[i]] = unit.shards[i].detach().clone().view(
                unit.w_layout.slots[i].shape)
    elif masters:
        out = torch.empty(unit.world * unit.g_layout.slot_numel, dtype=unit.master_dtype,
                          device=unit.device)
        unit.comm.all_gather(out, unit.master)
        for i, t in zip(masters, unit.g_layout.unpack(out)):
            values[unit.names[i]] = t
    if not whole:
        rest = [i for i in range(len(unit.params)) if unit.names[i] not in values]
        out = torch.empty(unit.world * unit.w_layout.slot_numel, dtype=unit.compute_dtype,
                          device=unit.device)
        unit.comm.all_gather(out, unit.w_shard)
        full = unit.w_layout.unpack(out)
        for i in rest:
            values[unit.names[i]] = full[i]
    return values


def measure(units, optimizer=None) -> dict[str, int]:
    """``{category: bytes}`` held on this rank by ``units``: each unit's own account
    (:func:`memory`), plus the communication buffers in flight, counted once
    where the units of a reduce bucket share one."""
    out: Counter[str] = Counter({c: 0 for c in CATEGORIES})
    in_flight: dict[int, object] = {}
    for u in units:
        out.update(memory(u, optimizer))
        for t in buffers_in_flight(u):
            base = t if t._base is None else t._base
            in_flight[id(base)] = base
    out["buffers"] += sum(tensor_bytes(t) for t in in_flight.values())
    return dict(out)
