"""Bytes on the wire per GPU per step, by level (ring accounting; ZeRO paper, section 7).

An all-reduce of T bytes over n ranks sends 2(n-1)/n·T per rank, a reduce-scatter or
all-gather (n-1)/n·T. DDP all-reduces the gradients; ZeRO-1/2 reduce-scatter them and
all-gather the updated weights; ZeRO-3 gathers the weights twice (forward and
backward), 1.5× DDP's bytes when gradients and weights travel in one dtype.

Hybrid sharding (``shard_group`` K; FSDP2's HSDP, DeepSpeed's MiCS): stage k shards
over a group of K of the data-parallel ranks and replicates across the R = dp / K
groups, so memory is the plain figure at K ranks (floor 16P/K at stage 3). Bytes per
level (``comm_bytes_by_level``): *inside* a group the stage's collectives over K ranks;
*across* groups one all-reduce of what the group reduced, over R ranks — each rank's
reduced gradient shard, ``ring_all_reduce(r·P/K, R)`` (stage 0: the whole gradients,
``ring_all_reduce(r·P, R)``, after the all-reduce over K inside).

[Note: hybrid sharding] in ``runtime/mesh.py`` is the engine's side; its ledger
(``comm_stats(by_level=True)``) records the same two levels, plus one presence flag per
parameter in each reduced slot, which the plan leaves out.

ZeRO++ (Wang et al., 2023; ``ZeroConfig``'s ``secondary_group``, ``quantize_weights``,
``quantize_grads`` and ``quant_block``), per unit of U elements (slot n = ⌈U/(tp·K)⌉,
K2 the secondary group):

- **hpZ** (stage 3): after a unit's forward each rank keeps K/K2 of its K slots until
  its backward, whose gather runs over the K2 ranks of a secondary group: level
  *secondary*, ``ring_one_way(K·n·w, K2)``; the forward's gather stays *inside*. Memory:
  ``K/K2·n·w`` per unit, every unit's held at the start of backward (``gathered`` in the
  engine's ``runtime/unit/readout.memory``).
- **qwZ** (stage 3): a gather of the weights over the shard group (forward; backward
  too unless hpZ keeps them) sends ``quantized_nbytes(n) = n + 4⌈n/B⌉`` bytes a slot
  (int8 and one fp32 scale per block of B), ``(K-1)·quantized_nbytes(n)`` per rank.
- **qgZ** (stages 1-3): the reduce-scatter over the shard group sends K quantized slots
  of the reduced slot's n elements (an all-to-all), ``(K-1)·quantized_nbytes(n)`` per
  rank; the all-reduce across replicas stays exact.

Those sums run over the units (``units``: their parameter counts; one unit of P when not
given), since every slot rounds its blocks up.

**Optimizers that are not elementwise** (``spec/optimizers.py``) send more each step,
once the stage shards their state: Muon's owner computes (``owner_gather``,
``owner_scatter``: :func:`owner_comm`, the bytes ``spec.optimizers.owner_bytes`` gives
each rank for the owners ``assign_owners`` picks, the same as the engine's ledger), and
the reducing optimizers' all-reduces of partial sums (Adafactor's two rounds, LAMB's
one, fp64: :func:`reduction_comm`).
"""

from __future__ import annotations

from ..spec.config import ZeroConfig
from ..spec.dims import ParallelDims
from ..spec.formulas import QUANT_BLOCK, ceil_div, quantized_nbytes, ring_all_reduce, ring_one_way
from ..spec.optimizers import OPTIMIZERS, Need, owner_bytes
from ..spec.recipes import DTYPE_BYTES
from .layout import check_layout, dp_degree, secondary, shard_degree  # noqa: F401 (re-exported)
from .placement import check_shaped


def uses_zeropp(config: ZeroConfig) -> bool:
    """Whether ``config`` takes any of ZeRO++'s hpZ, qwZ or qgZ."""
    return (config.secondary_group is not None or config.quantize_weights
            or config.quantize_grads)


def zeropp_dict(config: ZeroConfig | None) -> dict:
    """ZeRO++ as ``config`` takes it, for JSON (the defaults when it takes none)."""
    if config is None or not uses_zeropp(config):
        return {"hpz": None, "quantize_weights": False, "quantize_grads": False,
                "quant_block": QUANT_BLOCK}
    return {"hpz": config.secondary_group, "quantize_weights": config.quantize_weights,
            "quantize_grads": config.quantize_grads, "quant_block": config.quant_block}


def unit_slots(params: int, k: int, tp: int = 1, units: list[int] | None = None) -> list[int]:
    """Each unit's slot on one rank of ``k``: ⌈U/(tp·k)⌉ elements (one unit of all
    ``params`` when ``units`` is not given)."""
    sizes = [params] if units is None else units
    return [ceil_div(ceil_div(u, tp), k) for u in sizes]


def secondary_bytes(params: int, dims: ParallelDims, config: ZeroConfig,
                    units: list[int] | None = None) -> list[int]:
    """hpZ: per unit, the bytes one GPU keeps from its forward to its backward, K/K2 of
    its K slots, ``K/K2·n·w`` (empty without a secondary group; the engine's
    ``w_secondary``, counted under ``gathered``). At the start of backward every unit's
    is held."""
    check_layout(dims, config)
    return kept_secondary(params, dims, config, units)


def kept_secondary(params: int, dims: ParallelDims, config: ZeroConfig,
                   units: list[int] | None = None) -> list[int]:
    """:func:`secondary_bytes` on a layout its caller checked (``plan_strategy``)."""
    k, k2 = dims.shard_size, secondary(dims, config)
    if k2 is None:
        return []
    w = config.recipe.weight_bytes
    return [k // k2 * n * w for n in unit_slots(params, k, dims.tp, units)]


def comm_bytes(params: int, dims: ParallelDims, config: ZeroConfig,
               units: list[int] | None = None, trainable: int | None = None) -> int:
    """Bytes one GPU sends per step under ring accounting (its 1/tp of the model, over
    the data-parallel ranks): every level of :func:`comm_bytes_by_level`."""
    return sum(comm_bytes_by_level(params, dims, config, units, trainable).values())


def comm_bytes_by_level(params: int, dims: ParallelDims, config: ZeroConfig,
                        units: list[int] | None = None,
                        trainable: int | None = None) -> dict[str, int]:
    """Bytes one GPU sends per step at each level, as the engine's ledger splits them
    (``comm_stats(by_level=True)``):

    - ``inside`` a shard group of K ranks: stage 0 all-reduces the gradients,
      ``2(K-1)/K·r·P``; stages 1-2 reduce-scatter them and all-gather the updated
      weights, ``(K-1)/K·(r + w)·P``; stage 3 gathers twice, ``(K-1)/K·(r + 2w)·P``;
    - ``across`` the R = dp / K groups: one all-reduce of each rank's reduced gradient
      shard over its R replicas, ``2(R-1)/R·r·P/K`` (stage 0: of the whole gradients,
      ``2(R-1)/R·r·P``); 0 when plain (K = dp, R = 1).

    r and w are the reduce and weight bytes per element of ``config.recipe``; P is this
    GPU's 1/tp.

    ZeRO++ as ``config`` takes it: under hpZ the backward's gathers move to
    ``secondary``, ``ring_one_way(K·n·w, K2)`` per unit of slot n; qwZ sends
    ``(K-1)·quantized_nbytes(n)`` per gather of a unit's weights over the shard group,
    qgZ the same per reduce-scatter of its gradients. ``units``: the units' parameter
    counts, whose slots round up apart (one unit of P by default). ``secondary`` is a
    key only with a secondary group. ``trainable``: the parameters that train, of P
    (LoRA's adapters): the gradients reduced and the rows gathered after the step are
    theirs alone; stage 3 gathers every weight for forward and backward.
    """
    check_layout(dims, config)
    return traffic(params, dims, config, units, trainable)


def traffic(params: int, dims: ParallelDims, config: ZeroConfig,
            units: list[int] | None = None, trainable: int | None = None) -> dict[str, int]:
    """:func:`comm_bytes_by_level` on a layout its caller checked (``plan_strategy``)."""
    policy, recipe = config.policy, config.recipe
    k, k2 = dims.shard_size, secondary(dims, config)
    trained = params if trainable is None else trainable
    grads = ceil_div(recipe.reduce_bytes * trained, dims.tp)
    weights = ceil_div(recipe.weight_bytes * params, dims.tp)
    updated = ceil_div(recipe.weight_bytes * trained, dims.tp)
    if policy.reduce == "all_reduce":  # every rank keeps the average of every gradient
        return {"inside": ring_all_reduce(grads, k),
                "across": ring_all_reduce(grads, dims.replicas)}
    slots = unit_slots(params, k, dims.tp, units) if uses_zeropp(config) else []
    quantized = sum((k - 1) * quantized_nbytes(n, config.quant_block) for n in slots)
    gather = quantized if config.quantize_weights else ring_one_way(weights, k)
    levels = {"inside": quantized if config.quantize_grads else ring_one_way(grads, k),
              "across": ring_all_reduce(ceil_div(grads, k), dims.replicas)}
    if policy.gathers_after_step:  # the updated rows, once after the step
        levels["inside"] += quantized if config.quantize_weights else ring_one_way(updated, k)
    if policy.shards_params:  # gathered for forward, and again for backward
        levels["inside"] += gather
        if k2 is None:
            levels["inside"] += gather
        else:  # hpZ: the backward's, unquantized, over the secondary group
            levels["secondary"] = sum(ring_one_way(k * n * recipe.weight_bytes, k2)
                                      for n in slots)
    return levels


#: Bytes of each partial sum the reducing optimizers all-reduce (fp64).
SUM_BYTES = 8


def steps_shards(dims: ParallelDims, config: ZeroConfig) -> bool:
    """Whether the optimizer steps rows (the stage shards its state over K > 1 ranks),
    so that a non-elementwise one communicates."""
    return config.policy.shards_optimizer and dims.shard_size > 1


def owner_comm(shapes: list[tuple[int, ...]], dims: ParallelDims, config: ZeroConfig,
               rank: int | None = None) -> dict[str, int]:
    """Muon's owner-computes bytes per step (``owner_gather``, ``owner_scatter``) that
    ``rank`` of the shard group sends; ``rank`` None: the most any rank sends. Zero
    where the optimizer is not Muon or nothing is sharded."""
    check_shaped(dims, config)
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
    check_shaped(dims, config)
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
