"""Building a sharded model: checking that ranks agree, broadcasting rank 0's state,
and cutting the model into units (which unit owns which parameter)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from ...spec.policy import ShardPolicy
from ..comm.collectives import Collectives
from ..comm.context import CommContext
from ..dist import default_device
from ..events import Events
from ..unit.local import local, tp_dim
from ..unit.unit import Unit


def check_same_model(module: nn.Module, config) -> None:
    """Every rank must shard the same parameters with the same options: name the first
    difference (ranks that disagree would otherwise pair unlike collectives and hang)."""
    sig = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
    options = _options(module, config)
    sigs = [None] * dist.get_world_size()
    dist.all_gather_object(sigs, (options, sig))
    for rank, (other_options, other) in enumerate(sigs[1:], start=1):
        for key, value in sigs[0][0].items():
            if other_options[key] != value:
                raise ValueError(f"zs.shard() options differ between ranks: rank {rank} has "
                                 f"{key}={other_options[key]} where rank 0 has {key}={value}; "
                                 "every rank must shard with the same options")
        for a, b in zip(sigs[0][1], other):
            if a != b:
                raise ValueError(f"rank {rank}'s model differs from rank 0's: parameter {b[0]!r} "
                                 f"(shape {b[1]}, {b[2]}) where rank 0 has {a[0]!r} "
                                 f"(shape {a[1]}, {a[2]})")
        if len(other) != len(sigs[0][1]):
            raise ValueError(f"rank {rank}'s model has {len(other)} parameters, rank 0's "
                             f"{len(sigs[0][1])}")


def _options(module: nn.Module, config) -> dict[str, str]:
    """The config as text every rank can compare: modules named by their path in the
    model, classes by their qualified name."""
    names = {id(m): n for n, m in module.named_modules()}

    def text(v) -> str:
        if isinstance(v, nn.Module):
            return f"<module {names.get(id(v), '?')!r}>"
        if isinstance(v, type):
            return f"<class {v.__module__}.{v.__qualname__}>"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(text(x) for x in v) + "]"
        return repr(v)

    return {f.name: text(getattr(config, f.name)) for f in dataclasses.fields(config) if f.init}


def _broadcast_flat(tensors: list[torch.Tensor], comm: Collectives, tp: bool = False) -> None:
    """Rank 0's values of ``tensors`` everywhere: one flat broadcast per dtype, the dtypes
    in one order on every rank (a set's order differs between processes); with ``tp``,
    tp rank 0's to the tp group."""
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch._utils._flatten_dense_tensors(group)
        comm.broadcast(flat, src=0, tp=tp)
        for t, v in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
            t.copy_(v)


def broadcast_state(module: nn.Module, comm: Collectives) -> None:
    """Rank 0's parameters and buffers everywhere: beside tensor parallelism each tp
    rank's local slices over its data-parallel group, and what every tp rank holds
    whole (plain tensors, ``Replicate()`` DTensors) first from tp rank 0, as DTensor's
    ``distribute_tensor`` takes a replicated tensor from mesh coordinate 0."""
    tensors = [local(t).data for t in [*module.parameters(), *module.buffers()]
               if not t.is_meta]
    if comm.mesh.tp_world > 1:
        whole = [local(t).data for t in [*module.parameters(), *module.buffers()]
                 if not t.is_meta and tp_dim(t) is None]
        _broadcast_flat(whole, comm, tp=True)
    _broadcast_flat(tensors, comm)


def broadcast_buffers(module: nn.Module, comm: Collectives) -> None:
    """Rank 0's buffers everywhere (torch DDP's ``broadcast_buffers``, before a forward)."""
    buffers = [b for b in module.buffers() if not b.is_meta]
    if buffers:
        with torch.no_grad():
            _broadcast_flat(buffers, comm)


def build_units(module: nn.Module, inner: list[nn.Module], config, policy: ShardPolicy,
                comm: Collectives, ctx: CommContext, materializer,
                events: Events) -> list[Unit]:
    """A parameter belongs to the innermost unit that contains every module that
    registers it: a weight tied across two units (embedding and output head) moves
    to their common ancestor, which is gathered while both use it."""
    users: dict[int, set[int]] = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                users.setdefault(id(p), set()).add(id(m))
    depth = {id(m): n.count(".") + 1 for n, m in module.named_modules() if n}
    inside = {id(u): {id(m) for m in u.modules()} for u in inner}
    owner: dict[int, nn.Module] = {}
    for u in sorted(inner, key=lambda m: -depth[id(m)]):  # innermost claims first
        for p in u.parameters():
            if id(p) not in owner and users[id(p)] <= inside[id(u)]:
                owner[id(p)] = u
    if policy.shards_params:  # a unit is gathered by its forward hooks: it must be called
        for m in inner:
            if type(m).forward is nn.Module.forward and "forward" not in vars(m):
                # (a compiled module, torch.compile's OptimizedModule, has its own)
                raise ValueError(
                    f"units: {type(m).__name__} {_name(module, m)!r} is never called (it has "
                    "no forward), so at stage 3 its parameters could not be gathered before "
                    "use; name the module that calls its members instead")
    order = [module] + [m for m in module.modules() if m in inner]
    groups: dict[int, list[str]] = {id(m): [] for m in order}
    for n, p in module.named_parameters():
        groups[id(owner.get(id(p), module))].append(n)
    persistent: list[str] = []
    threshold = config.param_persistence_threshold if policy.shards_params else 0
    if threshold:
        for names_ in groups.values():
            persistent += [n for n in names_ if module.get_parameter(n).numel() < threshold]
            names_[:] = [n for n in names_ if module.get_parameter(n).numel() >= threshold]
    recipe, device = config.recipe, default_device()
    qualified = {id(m): n for n, m in module.named_modules()}

    def unit(index: int, m: nn.Module, params, unit_policy: ShardPolicy) -> Unit:
        return Unit(index, m, params, unit_policy, recipe, comm, ctx, device, events,
                    name=qualified[id(m)] or type(module).__name__)

    units = []
    for m in order:
        if materializer is not None:  # this unit's modules, materialized now
            materializer.materialize([module.get_parameter(n) for n in groups[id(m)]])
        params = [(n, module.get_parameter(n)) for n in groups[id(m)]]
        if params or m is module:
            units.append(unit(len(units), m, params, policy))
    if persistent:  # whole on every rank (stage 2's layout inside a stage-3 model),
        # built last (their modules are materialized by now) and reduced last
        if materializer is not None:
            materializer.materialize([module.get_parameter(n) for n in persistent])
        units.insert(0, unit(len(units), module,
                             [(n, module.get_parameter(n)) for n in persistent],
                             policy.whole_params()))
    return units


def _name(module: nn.Module, m: nn.Module) -> str:
    return next(n for n, x in module.named_modules() if x is m)
