"""The optimizer in the planner, where its bytes depend on the parameters' shapes
(``zeroshard plan --optimizer``; [Note: optimizer needs] in ``spec/optimizers.py``).

AdamW keeps two states an element wherever the element is; Muon and Adafactor do not:

- **Muon** (with AdamW for the rest, torch's documented use): one fp32 momentum per
  element of every 2-D parameter, AdamW's two for the others. Row-sharded like Adam's,
  so at K ranks a rank keeps its rows' share. Each step the owner of each matrix
  receives the other ranks' rows of the update (``owner_gather``, in the master dtype)
  and sends them their rows of the orthogonalised result (``owner_scatter``, bf16):
  :func:`owner_comm`, the bytes ``spec.optimizers.owner_bytes`` gives each rank for the
  owners ``assign_owners`` picks, the same as the engine's ledger.
- **Adafactor**: a matrix of R x C keeps a row statistic (R) and a column statistic
  (C); a vector one per element. The row statistic and a vector's are row-sharded; a
  matrix's column statistic spans every row, so each rank keeps it whole. Every step
  all-reduces, over the shard group, each parameter's sums of squares (the weight's and,
  in a second round, the update's) and a matrix's C + 1 column and row sums, fp64:
  :func:`reduction_comm`.

Memory is counted for rank 0 of the shard group (dim-0 chunks of c = ceil(d0/K) rows:
rank 0 holds the most), as :func:`~zeroshard.plan.state.model_state_bytes` does.
"""

from __future__ import annotations

from ..spec.config import ZeroConfig
from ..spec.dims import ParallelDims
from ..spec.formulas import dim0_rows, ring_all_reduce
from ..spec.optimizers import OPTIMIZERS, Need, owner_bytes, state_elements
from ..spec.recipes import DTYPE_BYTES
from .arch import ModelSpec
from .layout import check_layout
from .shapes import arch_shapes

#: Bytes of each partial sum the reducing optimizers all-reduce (fp64).
SUM_BYTES = 8


def model_shapes(model: ModelSpec) -> list[tuple[int, ...]] | None:
    """The parameters' shapes of ``model``: its own, its architecture's, or None for a
    bare parameter count."""
    if model.shapes is not None:
        return list(model.shapes)
    return arch_shapes(model.arch) if model.arch is not None else None


def _check(dims: ParallelDims, config: ZeroConfig) -> None:
    check_layout(dims, config)
    if dims.tp > 1:
        raise ValueError(f"--optimizer {config.recipe.optimizer} counts each parameter's "
                         f"rows, and tensor parallelism (tp={dims.tp}) splits them further; "
                         "plan it with tp=1, or with --optimizer adamw")


def _rows(shape: tuple[int, ...], dims: ParallelDims, config: ZeroConfig,
          rank: int = 0) -> int:
    """The dim-0 rows of a parameter ``rank`` keeps the optimizer state of."""
    rows = shape[0] if shape else 1
    if not config.policy.shards_optimizer:
        return rows
    a, b = dim0_rows(rows, rank, dims.shard_size)
    return b - a


def state_bytes(shapes: list[tuple[int, ...]], dims: ParallelDims, config: ZeroConfig,
                rank: int = 0) -> int:
    """Bytes of optimizer state (the master left out) one rank keeps for ``shapes``
    under ``config.recipe.optimizer``."""
    _check(dims, config)
    opt = OPTIMIZERS[config.recipe.optimizer]
    item = DTYPE_BYTES[config.recipe.state_dtype]
    return item * sum(state_elements(opt, s, _rows(s, dims, config, rank)) for s in shapes)


def steps_shards(dims: ParallelDims, config: ZeroConfig) -> bool:
    """Whether the optimizer steps rows (the stage shards its state over K > 1 ranks),
    so that a non-elementwise one communicates."""
    return config.policy.shards_optimizer and dims.shard_size > 1


def owner_comm(shapes: list[tuple[int, ...]], dims: ParallelDims, config: ZeroConfig,
               rank: int | None = None) -> dict[str, int]:
    """Muon's owner-computes bytes per step (``owner_gather``, ``owner_scatter``) that
    ``rank`` of the shard group sends; ``rank`` None: the most any rank sends. Zero
    where the optimizer is not Muon or nothing is sharded."""
    _check(dims, config)
    out = {"owner_gather": 0, "owner_scatter": 0}
    opt = OPTIMIZERS[config.recipe.optimizer]
    if opt.need is not Need.WHOLE_MATRIX or not steps_shards(dims, config):
        return out
    matrices = [s for s in shapes if len(s) == 2]
    item = DTYPE_BYTES[config.recipe.master_dtype or config.recipe.param_dtype]
    k = dims.shard_size
    ranks = range(k) if rank is None else [rank]
    per = [owner_bytes(matrices, k, r, item) for r in ranks]
    return max(per, key=lambda b: (b["owner_gather"] + b["owner_scatter"], -per.index(b)))


def reduction_comm(shapes: list[tuple[int, ...]], dims: ParallelDims,
                   config: ZeroConfig) -> int:
    """Bytes a rank sends per step in the all-reduces of a reducing optimizer's partial
    sums (ring accounting, fp64): Adafactor's two rounds (each parameter's weight norm,
    a matrix's C + 1 column and row sums; then each update's norm), LAMB's one (the
    weight's and the update's norms). Zero for the others, or where nothing is sharded."""
    _check(dims, config)
    opt = OPTIMIZERS[config.recipe.optimizer]
    if opt.need is not Need.REDUCTIONS or not steps_shards(dims, config):
        return 0
    k = dims.shard_size
    if opt.factored:  # Adafactor
        first = sum(1 + (s[1] + 1 if len(s) == 2 else 0) for s in shapes)
        return (ring_all_reduce(first * SUM_BYTES, k)
                + ring_all_reduce(len(shapes) * SUM_BYTES, k))
    return ring_all_reduce(2 * len(shapes) * SUM_BYTES, k)  # LAMB


def optimizer_comm(shapes: list[tuple[int, ...]] | None, dims: ParallelDims,
                   config: ZeroConfig) -> int:
    """Every byte a rank sends per step for the optimizer beyond the stage's own
    collectives (the most any rank sends): Muon's owner computes, or the reducing
    optimizers' all-reduces. Zero without shapes or for an elementwise optimizer."""
    if shapes is None or OPTIMIZERS[config.recipe.optimizer].need is Need.ELEMENTWISE:
        return 0
    return sum(owner_comm(shapes, dims, config).values()) + reduction_comm(shapes, dims,
                                                                           config)
