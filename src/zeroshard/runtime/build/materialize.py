"""Models built on the meta device: each unit is materialized, initialised and sharded in
turn, so a rank never holds more than one full unit beside its shards.

[Note: seeded initialisation] Every module is initialised under its own seed, derived
from the run's seed and the module's qualified name, so the values do not depend on
the order in which units are materialized: ``init_weights(model, seed)`` on an ordinary
model gives exactly the weights that ``shard`` of the same model built on the meta
device starts from. A parameter shared by two modules (tied embeddings) is written by
both inits, in model order, in both paths.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.nn as nn

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
