"""Making a sharded model: which modules become units, a model built on the meta
device materialized unit by unit, the ranks agreeing on the model, rank 0's state
broadcast, and the units made.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..spec.policy import ShardPolicy
from .collectives import Collectives
from .dist import default_device
from .events import Events
from .schedule import CommContext
from .unit import Unit, local, tp_dim

# ----------------------------------------------------------------------------------------
# Unit policies: which modules become units.
#
# A unit is gathered and reduced as one buffer (one all-gather and one reduce-scatter per
# pass). Too fine and every tiny collective pays its start-up cost; too coarse and the
# gathered unit dominates peak memory. The default follows FSDP practice: one unit per
# repeated block (each transformer block), plus a root unit for everything else.
# ----------------------------------------------------------------------------------------

def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """Children of every outermost ``ModuleList``/``Sequential`` whose members (at least
    two, with parameters) share one class: the model's repeated blocks."""
    found: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            kids = list(child.children()) if isinstance(child, (nn.ModuleList, nn.Sequential)) \
                else []
            if len(kids) >= 2 and len({type(k) for k in kids}) == 1 and all(map(_has_params, kids)):
                found.extend(kids)
            else:
                visit(child)

    visit(model)
    return found


def by_class(model: nn.Module, classes: tuple[type, ...]) -> list[nn.Module]:
    """The outermost modules that are instances of ``classes``."""
    found: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, classes):
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found


def by_size(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Bottom-up: a module becomes a unit once the parameters it holds that no inner
    unit took reach ``min_params`` (FSDP's size-based policy)."""
    found: list[nn.Module] = []
    taken: set[int] = set()

    def visit(m: nn.Module) -> None:
        for child in m.children():
            visit(child)
            free = sum(p.numel() for p in child.parameters() if id(p) not in taken)
            if free >= min_params:
                found.append(child)
                taken.update(id(p) for p in child.parameters())

    visit(model)
    return found


def select_units(model: nn.Module, units) -> list[nn.Module]:
    """Modules that become units (the root unit comes on top), from a policy:

    - ``"blocks"`` (default): :func:`repeated_blocks`;
    - ``None`` or ``"model"``: no inner units, the whole model is one unit;
    - a module class or a tuple/list of classes: every outermost instance;
    - a list of modules: exactly those;
    - an int: :func:`by_size` with that many parameters per unit.
    """
    if units is None or units == "model":
        return []
    if units == "blocks":
        return repeated_blocks(model)
    if isinstance(units, bool):
        raise ValueError(f"units={units!r} is not a unit policy")
    if isinstance(units, int):
        if units <= 0:
            raise ValueError(f"units={units} must be a positive parameter count")
        return by_size(model, units)
    if isinstance(units, type) and issubclass(units, nn.Module):
        return by_class(model, (units,))
    if isinstance(units, Sequence) and not isinstance(units, str) and units:
        if all(isinstance(u, type) and issubclass(u, nn.Module) for u in units):
            return by_class(model, tuple(units))
        if all(isinstance(u, nn.Module) for u in units):
            inside = {id(m) for m in model.modules()}
            for u in units:
                if id(u) not in inside:
                    raise ValueError(f"units: {type(u).__name__} module is not part of the model")
                if u is model:
                    raise ValueError("units: the model itself is always the root unit; "
                                     "list only inner modules")
            return list(units)
    raise ValueError(
        f"units={units!r} is not a unit policy; expected 'blocks', 'model', None, a module "
        "class, a list of classes, a list of modules, or a parameter count")


# ----------------------------------------------------------------------------------------
# Models built on the meta device: each unit is materialized, initialised and sharded in
# turn, so a rank never holds more than one full unit beside its shards.
#
# [Note: seeded initialisation] Every module is initialised under its own seed, derived
# from the run's seed and the module's qualified name, so the values do not depend on
# the order in which units are materialized: ``init_weights(model, seed)`` on an ordinary
# model gives exactly the weights that ``shard`` of the same model built on the meta
# device starts from. A parameter shared by two modules (tied embeddings) is written by
# both inits, in model order, in both paths.
# ----------------------------------------------------------------------------------------

ParamInit = Callable[[nn.Module], None]


def reset_parameters(module: nn.Module) -> None:
    """The default initialisation: the module's own ``reset_parameters()``."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    elif any(p is not None for p in module._parameters.values()):
        raise ValueError(
            f"{type(module).__name__} has parameters but no reset_parameters(); pass "
            "param_init= a function that initialises one module's own parameters")


def _seeded(seed: int, name: str, module: nn.Module, param_init: ParamInit) -> None:
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        param_init(module)


def init_weights(model: nn.Module, seed: int = 0, param_init: ParamInit | None = None) -> None:
    """Initialise an ordinary (materialized) model exactly as :class:`Materializer` does."""
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            _seeded(seed, name, module, param_init or reset_parameters)


def has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


class Materializer:
    """Materializes, module by module, what the unit being built needs."""

    def __init__(self, model: nn.Module, device, seed: int, param_init: ParamInit | None):
        self.model, self.device, self.seed = model, device, seed
        self.param_init = param_init or reset_parameters
        self.done: set[int] = set()
        self.registrations: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for attr, p in module._parameters.items():
                if p is not None:
                    self.registrations.setdefault(id(p), []).append((module, attr))

    def _swap(self, old: nn.Parameter) -> nn.Parameter:
        """Replace a meta parameter by an empty one on the device, in every module that
        registers it (so tied parameters stay tied)."""
        new = nn.Parameter(torch.empty_like(old, device=self.device),
                           requires_grad=old.requires_grad)
        regs = self.registrations.pop(id(old))
        for module, attr in regs:
            module._parameters[attr] = new
        self.registrations[id(new)] = regs
        return new

    def materialize(self, params: list[nn.Parameter]) -> None:
        """Materialize and initialise every module that registers one of ``params``."""
        wanted = {id(p) for p in params}
        for name, module in self.model.named_modules():
            if id(module) in self.done:
                continue
            own = [p for p in module._parameters.values() if p is not None]
            if not any(id(p) in wanted for p in own):
                continue
            for p in own:
                if p.is_meta:  # a tied parameter is swapped once; its other users see it
                    wanted.add(id(self._swap(p)))
            for bname, b in module._buffers.items():
                if b is not None and b.is_meta:
                    module._buffers[bname] = torch.empty_like(b, device=self.device)
            _seeded(self.seed, name, module, self.param_init)
            self.done.add(id(module))

    def finish(self) -> None:
        """Buffers of modules without parameters (e.g. rotary tables): initialise them."""
        for name, module in self.model.named_modules():
            metas = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
            for bname in metas:
                module._buffers[bname] = torch.empty_like(module._buffers[bname],
                                                          device=self.device)
            if metas and id(module) not in self.done:
                if self.param_init is reset_parameters and not hasattr(module,
                                                                       "reset_parameters"):
                    raise ValueError(
                        f"buffer {name}.{metas[0]} is on the meta device and "
                        f"{type(module).__name__} has no reset_parameters() to fill it; pass "
                        "param_init=")
                _seeded(self.seed, name, module, self.param_init)


# ----------------------------------------------------------------------------------------
# Building a sharded model: checking that ranks agree, broadcasting rank 0's state,
# and cutting the model into units (which unit owns which parameter).
# ----------------------------------------------------------------------------------------

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
