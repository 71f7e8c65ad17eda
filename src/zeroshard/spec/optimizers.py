"""What an optimizer needs beyond the rows a rank holds, decided once (torch-free).

[Note: optimizer needs] ZeRO stages 1-3 give rank r the dim-0 rows ``[r·c, r·c + c)``
of every parameter (c = ceil(d0 / K) over a shard group of K), and the optimizer state
of those rows. An update is exact on them when it needs nothing else; the optimizers
the engine steps on shards fall in three classes by what else they need:

- **elementwise** (SGD, Adam, AdamW, ...): each element's update reads only that
  element's weight, gradient and state (ZeRO paper, section 5.1). torch's own step on
  the rows is the unsharded update, bit for bit.
- **reductions** (Adafactor, LAMB, LARS, Adam-mini): the update also reads a few sums
  over a whole tensor: a norm (LAMB's trust ratio ||w|| / ||u||, Adafactor's RMS of the
  weight and of the update), or sums over rows (Adafactor's column statistics, the
  mean of its row statistics). Each is a sum of per-row parts, so every rank adds up its
  own rows and one small all-reduce over the shard group, of every such sum of every
  parameter concatenated, gives the whole-tensor value on every rank (the source
  documents' "all-reduce of local sums of squares", as for clipping). The rest of the
  update stays on the rows. Adafactor needs two rounds: its update's norm depends on
  the column statistics the first round completes.
- **whole matrix** (Muon; Shampoo/SOAP-style preconditioners would be too): the update
  of a matrix is a function of the whole matrix (Muon's Newton-Schulz iteration
  orthogonalises it), not a sum of row parts. The engine computes it by **owner
  computes**: each matrix is assigned to one rank of the shard group (balanced by its
  cost, :func:`assign_owners`), every rank sends the owner its rows of the input (one
  all-to-all for all matrices: the ledger's ``owner_gather``), the owner runs torch's
  own function on the whole matrix, and each rank receives its rows of the result (a
  second all-to-all, ``owner_scatter``). What can be elementwise stays on the rows:
  Muon's momentum buffer is updated by each rank for its rows, so the state stays
  row-sharded and checkpoints reshard it unchanged.

Anything else is refused where shards are stepped (stage >= 1), naming what is
supported; stage 0 steps whole parameters, where every optimizer is exact.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .formulas import dim0_rows


class Need(enum.Enum):
    """What an optimizer's update of a parameter reads beyond this rank's rows."""

    ELEMENTWISE = "elementwise"
    """Nothing: torch's own step on the rows is exact."""
    REDUCTIONS = "reductions"
    """Sums over the whole tensor (norms, row or column sums): one small all-reduce of
    every parameter's partial sums per round."""
    WHOLE_MATRIX = "whole_matrix"
    """The whole matrix: owner computes, through two all-to-alls a step."""


#: torch optimizers (by class name) whose update is elementwise.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop",
               "Rprop", "ASGD", "Adadelta", "SparseAdam", "HostAdamW")

#: Optimizers the engine steps on shards beyond the elementwise ones: class name ->
#: (need, what the update reads beyond the rows).
STEPPED = {
    "Adafactor": (Need.REDUCTIONS, "the RMS of each weight and of its update, and column "
                                   "statistics summed over every row of each matrix"),
    "Lamb": (Need.REDUCTIONS, "the norms of each whole weight and of its update"),
    "Muon": (Need.WHOLE_MATRIX, "the Newton-Schulz orthogonalisation of each whole matrix"),
}

#: Optimizers refused on shards, and why: what they need cannot be classified above, or
#: is computed inside their own step where the engine cannot supply the whole-tensor sums.
REFUSED = {
    "LBFGS": "it runs a line search over the whole model's flattened parameters",
    "LAMB": "its trust ratio divides the norm of the whole weight by the whole update, "
            "inside its own step",
    "FusedLamb": "its trust ratio divides the norm of the whole weight by the whole update, "
                 "inside its own step",
    "LARS": "its trust ratio divides the norm of the whole weight by the whole gradient, "
            "inside its own step",
    "Shampoo": "its preconditioners are built from whole matrices inside its own step",
    "SOAP": "its preconditioners are built from whole matrices inside its own step",
}


def supported() -> str:
    """The optimizers that may step shards, for error messages."""
    return ", ".join([*ELEMENTWISE, "torch.optim.Adafactor", "torch.optim.Muon",
                      "zeroshard.optim.Lamb"])


# -- the planner's names --------------------------------------------------------------


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer as the planner counts it (``zeroshard plan --optimizer``)."""

    name: str
    need: Need
    states: int
    """Per-element states of the parameters it steps (AdamW's m and v: 2; Muon's
    momentum: 1; Adafactor's factored matrices: 0, see ``factored``)."""
    factored: bool = False
    """Adafactor: a matrix keeps a row and a column statistic instead of per-element
    second moments; a vector keeps one per element."""
    matrices_only: bool = False
    """Muon steps the 2-D parameters; the rest goes to AdamW (torch's documented use)."""


OPTIMIZERS = {o.name: o for o in (
    OptimizerSpec("adamw", Need.ELEMENTWISE, 2),
    OptimizerSpec("sgd", Need.ELEMENTWISE, 1),
    OptimizerSpec("lamb", Need.REDUCTIONS, 2),
    OptimizerSpec("adafactor", Need.REDUCTIONS, 0, factored=True),
    OptimizerSpec("muon", Need.WHOLE_MATRIX, 1, matrices_only=True),
)}


def get_optimizer(name: str) -> OptimizerSpec:
    """A planner optimizer by name; the error lists the known ones."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer={name!r}; expected one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def state_elements(opt: OptimizerSpec, shape: tuple[int, ...], rows: int) -> int:
    """Elements of per-parameter optimizer state one rank keeps for a parameter of
    ``shape`` of which it holds ``rows`` dim-0 rows (all of them when unsharded); scalar
    step counters are not counted. Muon's pairing: a non-matrix gets AdamW's two.

    Adafactor (torch's layout): a tensor of two or more dims keeps ``row_var`` (its
    shape with the last dim 1) and ``col_var`` (with dim -2 set to 1); for a matrix
    the column statistic spans every row, so every rank keeps it whole, of
    ``shape[-1]`` elements; a vector keeps ``variance``, one per element."""
    row = 1
    for d in shape[1:]:
        row *= d
    if opt.matrices_only and len(shape) != 2:
        return OPTIMIZERS["adamw"].states * rows * row
    if not opt.factored or len(shape) < 2:
        return (opt.states if not opt.factored else 1) * rows * row
    row_var = rows * row // shape[-1]  # [rows, *shape[1:-1], 1]
    col_var = shape[-1] if len(shape) == 2 else rows * row // shape[-2]  # dim -2 set to 1
    return row_var + col_var


# -- owner computes -------------------------------------------------------------------

#: torch's Muon orthogonalises in bf16 (``_zeropower_via_newtonschulz``): its result,
#: which the owner sends back, has 2 bytes an element whatever the master's dtype.
ORTHO_BYTES = 2


def newton_schulz_flops(shape: tuple[int, int], steps: int) -> int:
    """Multiply-adds x 2 of Muon's quintic Newton-Schulz iteration on a matrix (Jordan
    et al., 2024; torch's ``_zeropower_via_newtonschulz``): with m = min(shape), n =
    max(shape), each step forms A = X·Xᵀ (2m²n), B = b·A + c·A·A (2m³) and B·X (2m²n)."""
    m, n = min(shape), max(shape)
    return steps * (4 * m * m * n + 2 * m * m * m)


def assign_owners(shapes: list[tuple[int, int]], world: int, steps: int = 5) -> list[int]:
    """The rank of ``world`` that computes each matrix's update: longest processing time
    first (Graham, 1969), the costliest matrix to the least loaded rank (the lowest rank
    on a tie), so the slowest owner is within 4/3 of the best balance. Matrices are taken
    in order of cost, then shape, so the ranks' loads and bytes depend only on the
    shapes, not on the order the optimizer lists them (the planner gives the same
    answer as the engine)."""
    order = sorted(range(len(shapes)), key=lambda j: (-newton_schulz_flops(shapes[j], steps),
                                                      shapes[j], j))
    load, owner = [0] * world, [0] * len(shapes)
    for j in order:
        r = min(range(world), key=lambda k: (load[k], k))
        owner[j] = r
        load[r] += newton_schulz_flops(shapes[j], steps)
    return owner


def owner_bytes(shapes: list[tuple[int, int]], world: int, rank: int, item: int,
                steps: int = 5) -> dict[str, int]:
    """Bytes ``rank`` sends per step for the matrices ``shapes`` under owner computes:
    its rows of each matrix another rank owns, ``item`` bytes an element
    (``owner_gather``), and, of each matrix it owns, every other rank's rows of the
    result in bf16 (``owner_scatter``). What a rank keeps for itself is not sent."""
    owners = assign_owners(shapes, world, steps)
    gather = scatter = 0
    for shape, owner in zip(shapes, owners):
        a, b = dim0_rows(shape[0], rank, world)
        if owner != rank:
            gather += (b - a) * shape[1] * item
        else:
            scatter += (shape[0] - (b - a)) * shape[1] * ORTHO_BYTES
    return {"owner_gather": gather, "owner_scatter": scatter}


def whole_state(optimizer: str, key: str, ndim: int) -> bool:
    """Whether optimizer state ``key`` of a parameter of ``ndim`` dimensions is the same
    whole tensor on every rank rather than rows: Adafactor's column statistic of a
    matrix (its dim -2 is dim 0, summed over every rank's rows). Checkpoints keep such a
    state whole instead of slicing it."""
    return optimizer == "Adafactor" and key == "col_var" and ndim == 2
