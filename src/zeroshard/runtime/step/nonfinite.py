"""Non-finite gradients: found once, agreed by every rank, acted on alike.

A NaN or inf in one rank's local gradients reaches every rank through the reduction
(a sum with a NaN is NaN), so after it each rank's share of the reduced gradients says
whether the step is safe — but each rank sees only its share. One small exchange of a
flag per rank makes the verdict global, so every rank raises, skips or steps together;
a verdict per rank would let the ranks' weights drift apart for good.

When the cycle's gradients were clipped, the global norm (already the same on every
rank, ``clip.py``) is non-finite exactly when some gradient is, and no exchange is
needed. ``ZeroConfig.nonfinite`` picks the policy (``spec.config.NONFINITE_POLICIES``).
"""

from __future__ import annotations

import torch

from ..unit.readout import norm_grads


class NonFiniteGradients(FloatingPointError):
    """The reduced gradients of a step hold a NaN or an inf (``nonfinite="raise"``)."""


def first_bad_unit(units) -> int:
    """1 + the index of the first unit whose gradient rows this rank counts (its own, as
    for the global norm) hold a NaN or inf; 0 when all are finite. One pass over this
    rank's 1/N of the gradients (an infinity norm, which propagates NaN) and one host
    synchronisation."""
    grads, owner = [], []
    for k, u in enumerate(units):
        for g in norm_grads(u):
            if g.numel():
                grads.append(g)
                owner.append(k)
    if not grads:
        return 0
    finite = torch.stack(torch._foreach_norm(grads, float("inf"))).isfinite().tolist()
    bad = next((owner[j] for j, ok in enumerate(finite) if not ok), None)
    return 0 if bad is None else bad + 1


def verdict(units, comm, norm: torch.Tensor | None, step: int) -> str | None:
    """None when every rank's gradients are finite, else the error message (the same
    text on every rank). ``norm``: the cycle's global gradient norm if it was clipped."""
    if norm is not None:
        if bool(torch.isfinite(norm)):
            return None
        where = f"the global gradient norm is {norm.item()}"
    else:
        found = comm.agree(first_bad_unit(units))()
        if not any(found):
            return None
        where = "non-finite values in " + "; ".join(
            f"rank {r}'s rows of unit {k - 1} ({units[k - 1].name})"
            for r, k in enumerate(found) if k)
    return (f"non-finite gradients at step {step}: {where}. A NaN or inf in any rank's "
            "loss or gradients reaches every rank's reduced gradients; find its source "
            "(the input batch, the learning rate, the loss), or let such steps be skipped "
            "on every rank with nonfinite='skip' (zeroshard train --nonfinite skip)")
