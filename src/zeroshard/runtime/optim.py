"""Which optimizers may step a shard.

ZeRO-1 and beyond rely on the update being elementwise: each element's new value
depends only on that element's weight, gradient and state, so rank r can update its
slice alone and the result equals the unsharded update exactly (ZeRO paper, section
5.1). An optimizer that looks across elements — a trust ratio over the whole tensor
(LAMB, LARS), factored second moments over rows and columns (Adafactor), an
orthogonalised matrix update (Muon), a line search over the whole model (LBFGS) —
would see only a slice and compute something else, silently.
"""

from __future__ import annotations

import warnings

import torch

ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop",
               "Rprop", "ASGD", "Adadelta", "SparseAdam"}

NOT_ELEMENTWISE = {
    "LBFGS": "it runs a line search over the whole model's flattened parameters",
    "Adafactor": "its factored second moment averages over whole rows and columns",
    "Muon": "it orthogonalises each whole weight matrix",
    "Lamb": "its trust ratio divides the norm of the whole weight by the whole update",
    "LAMB": "its trust ratio divides the norm of the whole weight by the whole update",
    "FusedLamb": "its trust ratio divides the norm of the whole weight by the whole update",
    "LARS": "its trust ratio divides the norm of the whole weight by the whole gradient",
    "Shampoo": "its preconditioners are built from whole matrices",
}

_warned: set[str] = set()


def check_optimizer(optimizer: torch.optim.Optimizer, stage: int) -> None:
    """Refuse, at stage >= 1, an optimizer whose update is not elementwise."""
    name = type(optimizer).__name__
    if stage == 0 or name in ELEMENTWISE:
        return
    if name in NOT_ELEMENTWISE:
        raise ValueError(
            f"{name} cannot step ZeRO stage {stage} shards: {NOT_ELEMENTWISE[name]}, and each "
            "rank holds only a slice of every parameter, so the update would differ from the "
            "unsharded one. Use stage 0, or an elementwise optimizer "
            f"({', '.join(sorted(ELEMENTWISE))})")
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"zeroshard cannot tell whether {name} updates each element independently; at "
            f"stage {stage} each rank steps a slice, which is exact only for elementwise "
            "updates", stacklevel=3)
