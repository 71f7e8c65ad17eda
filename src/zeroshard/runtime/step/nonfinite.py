"""Non-finite gradients: found once, agreed by every rank, acted on alike.

A NaN or inf in one rank's local gradients reaches every rank through the reduction
(a sum with a NaN is NaN), so after it each rank's share of the reduced gradients says
whether the step is safe — but where a rank holds only its share (stages 1-3), it sees
only that share. One small exchange of a flag per rank makes the verdict global, so
every rank raises, skips or steps together; a verdict per rank would let the ranks'
weights drift apart for good.

The verdict costs what it must and no more ([Note: the cost of the verdict]):

- where the cycle's gradients were clipped, the global norm (already the same on every
  rank, ``clip.py``) is non-finite exactly when some gradient is: no scan, no exchange;
- where every rank holds the same averaged gradients (stage 0 without tensor
  parallelism: an all-reduce leaves the same bits on every rank), each rank scans them
  all and reaches the verdict every other rank reaches: no exchange;
- otherwise each rank scans its own rows and one exchange of a flag agrees.

[Note: the cost of the verdict] The scan is one sum per tensor, as DeepSpeed's overflow
check (``_has_inf_or_nan``): a NaN or an inf in a tensor makes its sum non-finite, and a
sum of finite values overflows only past 3.4e38, where the tensor is then looked at
element by element before it is called non-finite. A sum reads each element once with
no temporary: 1.6 ms for the 10.6M gradients of GPT medium on one CPU thread, against
33 ms for the infinity norm this replaced (which takes ``abs`` into a temporary first).
Exchanging the flag costs a small all-gather and a meeting of the ranks, about as much
again as scanning every row at stage 0, which is why stage 0 scans instead.
``ZeroConfig.nonfinite`` picks the policy (``spec.config.NONFINITE_POLICIES``).
"""

from __future__ import annotations

import torch

from ...spec.policy import FullGrads
from ..unit.layout import dim0_chunk
from ..unit.readout import norm_grads


class NonFiniteGradients(FloatingPointError):
    """The reduced gradients of a step hold a NaN or an inf (``nonfinite="raise"``)."""


def _first_bad(pieces: list[tuple[int, torch.Tensor]]) -> int:
    """1 + the first owner of a (owner, tensor) piece holding a NaN or inf; 0 if none.
    One sum per piece and one host synchronisation ([Note: the cost of the verdict])."""
    pieces = [(k, g) for k, g in pieces if g.numel()]
    if not pieces:
        return 0
    finite = torch.stack([g.sum() for _, g in pieces]).isfinite().tolist()
    for (k, g), ok in zip(pieces, finite):
        if not ok and not bool(g.isfinite().all()):  # not merely a sum past fp32's range
            return k + 1
    return 0


def first_bad_unit(units) -> int:
    """1 + the index of the first unit whose gradient rows this rank counts (its own, as
    for the global norm) hold a NaN or inf; 0 when all are finite."""
    return _first_bad([(k, g) for k, u in enumerate(units) for g in norm_grads(u)])


def _held_alike(units, comm) -> bool:
    """Whether every rank holds the same reduced gradients, all of them: stage 0's
    averaged full gradients, where tensor parallelism splits none."""
    return (comm.mesh.tp_world == 1
            and units[0].policy.full_grads is FullGrads.AVERAGED)


def _found_alike(units, world: int) -> list[int]:
    """Per rank of the shard group, what :func:`first_bad_unit` finds on that rank (the
    rows it would own: ``readout.norm_grads``), from the gradients every rank holds: one
    sum per tensor, and the rows of each rank only where one is non-finite."""
    whole = [(k, u.shards[i].grad) for k, u in enumerate(units) for i in u.trainable
             if u.shards[i].grad is not None]
    if not _first_bad(whole):
        return [0] * world
    found = []
    for r in range(world):
        pieces = []
        for k, u in enumerate(units):
            for i in u.trainable:
                g = u.shards[i].grad
                if g is not None:
                    rows = g.shape[0] if g.dim() else 1
                    a, b = dim0_chunk(rows, r, world)
                    pieces.append((k, g.reshape(rows, -1)[a:b]))
        found.append(_first_bad(pieces))
    return found


def verdict(units, comm, norm: torch.Tensor | None, step: int) -> str | None:
    """None when every rank's gradients are finite, else the error message (the same
    text on every rank). ``norm``: the cycle's global gradient norm if it was clipped."""
    if norm is not None:
        if bool(torch.isfinite(norm)):
            return None
        where = f"the global gradient norm is {norm.item()}"
    else:
        found = (_found_alike(units, comm.mesh.shard_world) if _held_alike(units, comm)
                 else comm.agree(first_bad_unit(units))())
        if not any(found):
            return None
        where = "non-finite values in " + "; ".join(
            f"rank {r}'s rows of unit {k - 1} ({units[k - 1].name})"
            for r, k in enumerate(found) if k)
    return (f"non-finite gradients at step {step}: {where}. A NaN or inf in any rank's "
            "loss or gradients reaches every rank's reduced gradients; find its source "
            "(the input batch, the learning rate, the loss), or let such steps be skipped "
            "on every rank with nonfinite='skip' (zeroshard train --nonfinite skip)")
