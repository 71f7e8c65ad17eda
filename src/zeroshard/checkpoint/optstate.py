"""The optimizer state in a checkpoint ([Note: format] in ``sharded.py``): which of
the optimizers given holds a parameter's state, and how each state tensor is laid out
across ranks, so that any N and stage can load it."""

from __future__ import annotations

import torch

from ..spec.optimizers import whole_state


def optimizers(optimizer) -> list:
    """``save``/``load``'s ``optimizer``: None, one, or a list (Muon for the matrices and
    AdamW for the rest), as a list."""
    if optimizer is None:
        return []
    return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]


def state_of(opts: list, shard) -> tuple[object | None, dict]:
    """The optimizer among ``opts`` that holds state for ``shard``, and that state."""
    for o in opts:
        if shard in o.state:
            return o, o.state[shard]
    return None, {}


def state_layout(optimizer, key: str, value, e) -> str:
    """How a state tensor of parameter ``e`` is saved: ``"scalar"`` (a step counter),
    ``"whole"`` (the same on every rank: Adafactor's column statistic of a matrix,
    ``spec.optimizers.whole_state``), or ``"rows"`` (one row per row the rank holds,
    any trailing shape: moments, Adafactor's row statistics), resliced on load."""
    if not torch.is_tensor(value) or value.dim() == 0:
        return "scalar"
    if whole_state(type(optimizer).__name__, key, len(e.shape)):
        return "whole"
    return "rows" if value.shape[0] == e.count else "whole"
