"""The verdict: per category, the largest difference between the sharded run and the
reference, where it is, and whether it is none, rounding, or a different computation.

[Note: the bound] Each rank's forward and backward on its rows is the reference's on the
same slice, operation for operation, so what may legitimately differ is only the order
in which sums across ranks are taken: the gradients' reduction (gloo's or NCCL's ring
or tree against the reference's rank order) and the whole-tensor sums that sharded
optimizers and clipping take as per-rank partial sums (``spec/optimizers.py``). Each
such sum of fp32 terms is exact to within a unit in the last place of its result, up to
``(N − 1)·u`` for N terms (Higham, *Accuracy and Stability of Numerical Algorithms*,
§4.2), u the unit roundoff of its dtype. How far K steps carry a one-ulp difference
depends on the model and the optimizer (Adam divides by the root of tiny second
moments; Muon's iteration and a bf16 cast amplify), so it is measured, not guessed: a
second reference nudges every reduced gradient element by −1, 0 or +1 ulp at random at
every step, and its distance from the first reference, tensor by tensor, is the *floor*
this very trial shows for reordered sums. A tensor of the sharded run is **within
rounding** when its largest difference, relative to the tensor's largest magnitude, is
at most ``16 × its floor + 4·u`` (the scalars of a category, its losses, share the
largest floor among them; u of the category's dtype: the compute dtype for
losses, the gradients' for gradients, the master's for weights and optimizer state): a
tensor that is itself rounding noise (a key projection's bias, whose gradient is zero
in exact arithmetic) has a floor near 1 and is checked for nothing more, while every
tensor with a signal is held to its own. A category is **bitwise** when every tensor is
equal; it **DIFFERS** when any tensor is past its bound, and the report names the one
furthest past. The initial weights are built by the same function under the same seed
on both sides: any difference there DIFFERS (nothing has been summed yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .outcome import Outcome

BITWISE, ROUNDING, DIFFERS = "bitwise", "within rounding", "DIFFERS"

#: Unit roundoff of each dtype: half the distance from 1 to the next float.
UNIT_ROUNDOFF = {"fp32": 2.0 ** -24, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}

#: The margin over the measured floor, and over u where nothing was reordered (see the
#: note): one nudge per element per step is a typical reordering, not the worst, and an
#: optimizer's own whole-tensor sums (Adafactor's, LAMB's), reordered on shards, are not
#: nudged; a sharded run that computes something else is off by orders of magnitude more
#: (a shard stepped as if whole: 1e-1 of a weight; a wrong divisor: the whole gradient).
FLOOR_MARGIN, ULP_MARGIN = 16.0, 4.0


@dataclass(frozen=True)
class Difference:
    """The largest difference of one category."""

    category: str
    tensors: int
    """Tensors compared."""
    abs_diff: float
    """The largest absolute difference of any element."""
    rel_diff: float
    """max |sharded − reference| / max |reference| of the tensor ``where``."""
    where: str
    """The tensor furthest past its bound (or nearest to it), or the first mismatch."""
    bound: float
    """The relative difference rounding allows that tensor ([Note: the bound])."""
    floor: float
    """The nudged reference's relative distance from the reference, in that tensor."""
    verdict: str
    """``bitwise``, ``within rounding`` or ``DIFFERS``."""
    note: str = ""
    """Why, where it DIFFERS for a reason other than size (a missing tensor, a shape)."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a − b|, that over max |b|) in float64."""
    a, b = a.detach().double(), b.detach().double()
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    if diff == 0:
        return 0.0, 0.0
    return diff, diff / scale if scale else float("inf")


def _worst(ours: dict, ref: dict, nudged: list[dict], u: float, exact: bool) -> tuple:
    """(largest abs, rel of the worst tensor, its name, its bound, its floor, every tensor
    equal): the worst tensor is the one furthest past its own bound, each tensor's bound
    ``16 × its floor + 4·u`` (``exact``: 0)."""
    largest_abs, worst, equal = 0.0, None, True
    floors = {name: 0.0 if exact else max([_rel(n[name], b)[1] for n in nudged if name in n]
                                          or [0.0])
              for name, b in ref.items()}
    if all(b.dim() == 0 for b in ref.values()) and floors:  # losses: one scale, one floor
        floors = dict.fromkeys(floors, max(floors.values()))
    for name, b in ref.items():
        a = ours[name]
        equal = equal and torch.equal(a.to(b.dtype), b)
        d_abs, d_rel = _rel(a, b)
        floor = floors[name]
        bound = 0.0 if exact else FLOOR_MARGIN * floor + ULP_MARGIN * u
        largest_abs = max(largest_abs, d_abs)
        ratio = d_rel / bound if bound else (float("inf") if d_rel else 0.0)
        if worst is None or ratio > worst[0]:
            worst = (ratio, d_rel, name, bound, floor)
    _, d_rel, name, bound, floor = worst
    return largest_abs, d_rel, name, bound, floor, equal


def _dtype_of(category: str, recipe) -> str:
    if category == "losses":
        return recipe.param_dtype
    if category.startswith("gradients"):
        return recipe.grad_dtype
    return recipe.master_dtype or recipe.param_dtype


def compare_category(category: str, ours: dict, ref: dict, nudged: list[dict],
                     recipe) -> Difference:
    """One category's :class:`Difference` (``nudged``: the tensors of the references
    whose distance from ``ref`` is the floor: the nudged one, and beside tensor
    parallelism the exact one)."""
    missing = sorted(set(ref) - set(ours))
    extra = sorted(set(ours) - set(ref))
    if missing or extra:
        name = (missing or extra)[0]
        side = "the sharded run lacks" if missing else "the reference lacks"
        return Difference(category, len(ref), float("inf"), float("inf"), name, 0.0, 0.0,
                          DIFFERS, f"{side} {len(missing or extra)} tensor(s), first {name}")
    shape = next((n for n in ref if ours[n].shape != ref[n].shape), None)
    if shape is not None:
        return Difference(category, len(ref), float("inf"), float("inf"), shape, 0.0, 0.0,
                          DIFFERS, f"shape {tuple(ours[shape].shape)} against the "
                          f"reference's {tuple(ref[shape].shape)}")
    exact = category == "initial weights"
    u = UNIT_ROUNDOFF[_dtype_of(category, recipe)]
    d_abs, d_rel, where, bound, floor, equal = _worst(ours, ref, nudged, u, exact)
    verdict = BITWISE if equal else ROUNDING if d_rel <= bound else DIFFERS
    note = ("the model is built differently on the ranks and in the reference: build_model "
            "must give the same weights under the same seed"
            if verdict == DIFFERS and category == "initial weights" else "")
    return Difference(category, len(ref), d_abs, d_rel, where, bound, floor, verdict, note)


def compare(ours: Outcome, ref: Outcome, nudged: list[Outcome], recipe) -> list[Difference]:
    """Every category's difference, in the report's order (``nudged``: the references
    the floor is measured from)."""
    floors = [n.categories() for n in nudged]
    mine, theirs = ours.categories(), ref.categories()
    rows = []
    for category in dict.fromkeys([*theirs, *mine]):
        rows.append(compare_category(category, mine.get(category, {}),
                                     theirs.get(category, {}),
                                     [f.get(category, {}) for f in floors], recipe))
    return rows


def overall(rows: list[Difference]) -> str:
    """DIFFERS if any category does; within rounding if any is; else bitwise."""
    verdicts = {r.verdict for r in rows}
    return DIFFERS if DIFFERS in verdicts else ROUNDING if ROUNDING in verdicts else BITWISE
