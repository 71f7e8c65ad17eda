"""A parameter's local tensor: the one helper every storage, shape and ``.grad`` access
goes through, so a tensor-parallel parameter is handled exactly as a plain one.

[Note: tensor-parallel parameters] After torch's ``parallelize_module`` a parameter is a
DTensor ``nn.Parameter`` on the ``"tp"`` mesh: ``ColwiseParallel``'s weight is
``Shard(0)``, ``RowwiseParallel``'s ``Shard(1)``, its bias and ``SequenceParallel``'s norms
``Replicate()`` (``torch/distributed/tensor/parallel/style.py``). Autograd runs on the
DTensor, while its values live in a plain *local tensor* (``_local_tensor``), this tp
rank's slice. ZeRO shards that slice over the data-parallel ranks as it shards a plain
parameter (FSDP2 does the same: ``_init_sharding_spec_tp`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_param.py`` returns
``param._local_tensor`` for chunking), so a unit's layouts are over local shapes, its
storages hold local slices, and its reductions move local gradients. For a plain tensor
every function here is the identity.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


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
