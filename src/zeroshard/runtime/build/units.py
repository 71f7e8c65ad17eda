"""Unit policies: which modules become units.

A unit is gathered and reduced as one buffer (one all-gather and one reduce-scatter per
pass). Too fine and every tiny collective pays its start-up cost; too coarse and the
gathered unit dominates peak memory. The default follows FSDP practice: one unit per
repeated block (each transformer block), plus a root unit for everything else.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn


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
