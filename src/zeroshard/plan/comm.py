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

ZeRO++ (Wang et al., 2023; :class:`ZeroPP`, the engine's ``secondary_group``,
``quantize_weights``, ``quantize_grads``, ``quant_block``), per unit of U elements
(slot n = ⌈U/(tp·K)⌉, K2 the secondary group):

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
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.formulas import QUANT_BLOCK, ceil_div, quantized_nbytes, ring_all_reduce, ring_one_way
from ..spec.recipes import Recipe
from ..spec.rules import check_stage_options


def dp_degree(gpus: int, tp: int = 1) -> int:
    """Data-parallel ranks when ``gpus`` GPUs run tensor parallelism of degree ``tp``."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise ValueError(f"tp={tp!r} must be a positive integer")
    if gpus % tp:
        raise ValueError(f"gpus={gpus} is not divisible by tp={tp}")
    return gpus // tp


def shard_degree(gpus: int, tp: int = 1, shard_group: int | None = None) -> int:
    """K, the ranks a stage shards over: all ``gpus / tp`` data-parallel ranks, or with
    hybrid sharding a group of ``shard_group`` of them (R = dp / K replicas)."""
    dp = dp_degree(gpus, tp)
    k = shard_group
    if k is None:
        return dp
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(f"shard_group={k!r} must be a positive integer (None: all ranks)")
    if dp % k:
        ok = [d for d in range(1, dp + 1) if dp % d == 0]
        raise ValueError(f"shard_group={k} does not divide the {dp} data-parallel ranks; "
                         f"expected one of {ok}")
    return k



@dataclass(frozen=True)
class ZeroPP:
    """ZeRO++'s three options as the engine takes them (``ZeroConfig``: DeepSpeed's
    ``zero_hpz_partition_size``, ``zero_quantized_weights``, ``zero_quantized_gradients``);
    checked in the engine's words."""

    secondary_group: int | None = None
    """hpZ (stage 3): K2, the ranks of a secondary group inside the shard group that hold
    a unit's weights between its forward and its backward (None, or K2 = K: off)."""
    quantize_weights: bool = False
    """qwZ (stage 3): the weights' all-gathers over the shard group send int8 blocks."""
    quantize_grads: bool = False
    """qgZ (stages 1-3): the gradients' reduce-scatter sends int8 blocks; the all-reduce
    across replicas stays exact."""
    quant_block: int = QUANT_BLOCK
    """Elements per quantization block (one fp32 scale each)."""

    def __post_init__(self) -> None:
        k2 = self.secondary_group
        if k2 is not None and (isinstance(k2, bool) or not isinstance(k2, int) or k2 < 1):
            raise ValueError(f"secondary_group={k2!r}; expected None or an integer >= 1 "
                             "dividing the shard group")
        for name in ("quantize_weights", "quantize_grads"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        b = self.quant_block
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"quant_block={b!r} must be an integer >= 1")

    @property
    def active(self) -> bool:
        return (self.secondary_group is not None or self.quantize_weights
                or self.quantize_grads)

    def check(self, stage: int, recipe: Recipe | None = None) -> None:
        """A ValueError when ``stage`` (or the recipe's explicit reduce dtype) cannot take
        these options: the engine's own rules (``spec/rules.py``)."""
        check_stage_options(stage, secondary_group=self.secondary_group,
                            quantize_weights=self.quantize_weights,
                            quantize_grads=self.quantize_grads,
                            reduce_dtype=recipe.reduce_dtype if recipe is not None else None)

    def at(self, stage: int) -> ZeroPP:
        """The most of these options ``stage`` takes (hpZ and qwZ stage 3, qgZ stages
        1-3): the plan table shows each strategy so."""
        three = stage == 3
        return ZeroPP(self.secondary_group if three else None,
                      self.quantize_weights and three, self.quantize_grads and stage > 0,
                      self.quant_block)

    def secondary(self, k: int) -> int | None:
        """K2 inside a shard group of ``k`` (None: no secondary group, K2 absent or = K);
        one that does not divide ``k`` is refused as ``runtime/groups.secondary_size``
        does."""
        k2 = self.secondary_group
        if k2 is None or k2 == k:
            return None
        if k % k2:
            divisors = [d for d in range(1, k + 1) if k % d == 0]
            raise ValueError(f"secondary_group={k2} does not divide the shard group's {k} "
                             f"ranks; expected one of {divisors}")
        return k2

    def as_dict(self) -> dict:
        return {"hpz": self.secondary_group, "quantize_weights": self.quantize_weights,
                "quantize_grads": self.quantize_grads, "quant_block": self.quant_block}


def unit_slots(params: int, k: int, tp: int = 1, units: list[int] | None = None) -> list[int]:
    """Each unit's slot on one rank of ``k``: ⌈U/(tp·k)⌉ elements (one unit of all
    ``params`` when ``units`` is not given)."""
    sizes = [params] if units is None else units
    return [ceil_div(ceil_div(u, tp), k) for u in sizes]


def secondary_bytes(params: int, gpus: int, recipe: Recipe, stage: int,
                    shard_group: int | None = None, tp: int = 1, zeropp: ZeroPP | None = None,
                    units: list[int] | None = None) -> list[int]:
    """hpZ: per unit, the bytes one GPU keeps from its forward to its backward, K/K2 of
    its K slots, ``K/K2·n·w`` (empty without a secondary group; the engine's
    ``w_secondary``, counted under ``gathered``). At the start of backward every unit's
    is held."""
    z = zeropp or ZeroPP()
    z.check(stage)
    k = shard_degree(gpus, tp, shard_group)
    k2 = z.secondary(k)
    if k2 is None:
        return []
    return [k // k2 * n * recipe.weight_bytes for n in unit_slots(params, k, tp, units)]




def comm_bytes(params: int, gpus: int, recipe: Recipe, stage: int, tp: int = 1,
               shard_group: int | None = None, zeropp: ZeroPP | None = None,
               units: list[int] | None = None) -> int:
    """Bytes one GPU sends per step under ring accounting (its 1/tp of the model, over
    the ``gpus / tp`` data-parallel ranks): every level of :func:`comm_bytes_by_level`."""
    return sum(comm_bytes_by_level(params, gpus, recipe, stage, shard_group, tp, zeropp,
                                   units).values())


def comm_bytes_by_level(params: int, gpus: int, recipe: Recipe, stage: int,
                        shard_group: int | None = None, tp: int = 1,
                        zeropp: ZeroPP | None = None,
                        units: list[int] | None = None) -> dict[str, int]:
    """Bytes one GPU sends per step at each level, as the engine's ledger splits them
    (``comm_stats(by_level=True)``):

    - ``inside`` a shard group of K ranks: stage 0 all-reduces the gradients,
      ``2(K-1)/K·r·P``; stages 1-2 reduce-scatter them and all-gather the updated
      weights, ``(K-1)/K·(r + w)·P``; stage 3 gathers twice, ``(K-1)/K·(r + 2w)·P``;
    - ``across`` the R = dp / K groups: one all-reduce of each rank's reduced gradient
      shard over its R replicas, ``2(R-1)/R·r·P/K`` (stage 0: of the whole gradients,
      ``2(R-1)/R·r·P``); 0 when plain (K = dp, R = 1).

    r and w are the reduce and weight bytes per element; P is this GPU's 1/tp.

    ``zeropp`` (:class:`ZeroPP`, refused where the engine refuses it): under hpZ the
    backward's gathers move to ``secondary``, ``ring_one_way(K·n·w, K2)`` per unit of
    slot n; qwZ sends ``(K-1)·quantized_nbytes(n)`` per gather of a unit's weights over
    the shard group, qgZ the same per reduce-scatter of its gradients. ``units``: the
    units' parameter counts, whose slots round up apart (one unit of P by default).
    ``secondary`` is a key only with a secondary group.
    """
    z = zeropp or ZeroPP()
    z.check(stage, recipe)
    k = shard_degree(gpus, tp, shard_group)
    k2 = z.secondary(k)
    replicas = dp_degree(gpus, tp) // k
    grads = ceil_div(recipe.reduce_bytes * params, tp)
    weights = ceil_div(recipe.weight_bytes * params, tp)
    if stage == 0:
        return {"inside": ring_all_reduce(grads, k), "across": ring_all_reduce(grads, replicas)}
    slots = unit_slots(params, k, tp, units) if z.active else []
    quantized = sum((k - 1) * quantized_nbytes(n, z.quant_block) for n in slots)
    reduce = quantized if z.quantize_grads else ring_one_way(grads, k)
    gather = quantized if z.quantize_weights else ring_one_way(weights, k)
    levels = {"inside": reduce + gather, "across": ring_all_reduce(ceil_div(grads, k), replicas)}
    if stage == 3 and k2 is None:  # ZeRO-3 gathers for forward and again for backward
        levels["inside"] += gather
    elif stage == 3:  # hpZ: the backward's, unquantized, over the secondary group
        levels["secondary"] = sum(ring_one_way(k * n * recipe.weight_bytes, k2) for n in slots)
    return levels
