"""The memory and communication model of one strategy: :func:`plan_strategy`, and
:func:`plan_all` for every stage of one configuration.

Each strategy's bytes per GPU are its training state where the configuration places it
(``state.py``, ``offload.py``: stage k shards the first k of optimizer state, gradients
and weights over the K ranks of a shard group), its activations (``workload.py``) and
hpZ's secondary shards; its bytes on the wire per step are ``comm.py``'s (ring
accounting; ZeRO paper, section 7): DDP all-reduces the gradients, ZeRO-1/2
reduce-scatter them and all-gather the updated weights, ZeRO-3 gathers the weights
twice (forward and backward), so it moves 1.5× DDP's bytes when gradients and weights
travel in the same dtype.

The planner takes the configuration the engine runs ([Note: planner inputs] in
``layout.py``): a ``ZeroConfig`` and the ``ParallelDims`` it runs on. :func:`plan_all`
shows each stage with the most of the configuration's options that stage takes
(``ZeroConfig.at_stage``): hpZ and qwZ at stage 3, qgZ and offload at stages 1-3, the
weight shards' offload at stage 3.

Tensor parallelism of degree tp (``ParallelDims.tp``; Shoeybi et al., 2019) splits every
layer's matrices over tp GPUs, and ZeRO shards what each holds over the data-parallel
degree ``gpus / tp``; with the architecture known, what its plan leaves whole (norms,
row-parallel biases, the GPT's embeddings) is held whole on every tp GPU (``tp.py``).
Hybrid sharding (``ParallelDims.shard`` K; ``comm.py``): memory is
the plain figure at K ranks (floor 16P/K at stage 3) and the bytes split into two
levels. ZeRO++: hpZ keeps K/K2 of every unit's slots from its forward to its backward
(``StrategyPlan.secondary``, counted in ``total``) and moves the backward's gathers to
a third level, ``secondary``; qwZ and qgZ send quantized bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.config import ZeroConfig
from ..spec.dims import ParallelDims
from ..spec.formulas import ceil_div
from .arch import ModelSpec
from .comm import (  # noqa: F401 - re-exported: the planner's communication model
    QUANT_BLOCK,
    comm_bytes,
    comm_bytes_by_level,
    dp_degree,
    kept_secondary,
    optimizer_comm,
    quantized_nbytes,
    ring_all_reduce,
    ring_one_way,
    secondary_bytes,
    shard_degree,
    traffic,
    uses_zeropp,
    zeropp_dict,
)
from .layout import check_layout
from .placement import Placement, model_shapes, model_state_bytes, place  # noqa: F401 (re-exported)
from .tp import tp_counted, tp_unit_counts
from .workload import (  # noqa: F401 - re-exported: the activation model
    Workload,
    activation_bytes,
    activation_saved,
    tp_comm_bytes,
)

STRATEGIES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")


@dataclass(frozen=True)
class StrategyPlan:
    """Bytes per GPU for one strategy."""

    strategy: str
    weights: int
    grads: int
    optimizer: int
    activations: int | None
    comm: int
    """Bytes sent per GPU per step."""
    budget: int | None = None
    """GPU memory in bytes, when one was given."""
    tp: int = 1
    """Tensor-parallel degree; ZeRO shards over ``gpus / tp`` data-parallel ranks."""
    tp_comm: int = 0
    """Bytes sent per GPU per micro-batch in TP's activation all-reduces (beside ``comm``)."""
    shard_group: int | None = None
    """Hybrid sharding: the stage shards over groups of this many data-parallel ranks
    and replicates across the groups (None: over all of them)."""
    comm_across: int = 0
    """Of ``comm``, the bytes sent across shard groups (the replicas' all-reduce)."""
    offload: str | None = None
    """What this strategy keeps off the device (``plan/placement.py``); ``weights``,
    ``grads`` and ``optimizer`` are then the device's bytes."""
    placement: Placement | None = None
    """With ``offload``: the :class:`~zeroshard.plan.placement.Placement` at the step."""
    secondary: int = 0
    """hpZ: bytes of every unit's secondary shards, held at the start of backward
    (K/K2 of the weights' K slots; the engine's ``gathered``); in ``total``."""
    comm_secondary: int = 0
    """Of ``comm``, the bytes of hpZ's backward gathers inside the secondary groups."""
    config: ZeroConfig | None = None
    """The configuration this strategy was planned at (``ZeroConfig.at_stage``: its
    offload and ZeRO++ as far as the stage takes them)."""

    @property
    def host(self) -> int:
        """Host bytes per GPU (master, optimizer state, fp32 gradients; weight shards)."""
        return 0 if self.placement is None else self.placement.host.total

    @property
    def comm_inside(self) -> int:
        """Of ``comm``, the bytes sent inside the shard group (all of it when plain and
        without hpZ)."""
        return self.comm - self.comm_across - self.comm_secondary

    @property
    def total(self) -> int:
        return (self.weights + self.grads + self.optimizer + (self.activations or 0)
                + self.secondary)

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else self.total <= self.budget

    def as_dict(self) -> dict:
        return {
            "strategy": self.strategy,
            "weights": self.weights,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "total": self.total,
            "comm": self.comm,
            "fits": self.fits,
            "tp": self.tp,
            "tp_comm": self.tp_comm,
            "shard_group": self.shard_group,
            "comm_inside": self.comm_inside,
            "comm_across": self.comm_across,
            "offload": self.offload,
            "host": self.host,
            "placement": None if self.placement is None else self.placement.as_dict(),
            "secondary": self.secondary,
            "comm_secondary": self.comm_secondary,
            **zeropp_dict(self.config),
        }


def stage_of(strategy: str | int) -> int:
    """0–3 from a strategy name ("DDP", "ZeRO-2", "zero3", "2") or a stage number."""
    key = str(strategy).strip().lower().replace("-", "").replace("_", "")
    names = {"ddp": 0, "0": 0, "zero0": 0, "zero1": 1, "1": 1, "zero2": 2, "2": 2,
             "zero3": 3, "3": 3, "fsdp": 3}
    if isinstance(strategy, bool) or key not in names:
        raise ValueError(
            f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)} or 0-3"
        )
    return names[key]


def unit_sizes(model: ModelSpec, blocks_per_unit: int = 1) -> list[int]:
    """Parameters per unit as the engine's ``units="blocks"`` makes them: the root unit
    (embeddings, final norm, head), then ``blocks_per_unit`` blocks a unit (the last
    takes the rest). A bare count with layers: L blocks of P/L (summing to P, nothing
    in the root); without layers, one unit."""
    if not model.layers:
        return [model.params]
    if model.arch is None:
        base, extra = divmod(model.params, model.layers)
        blocks, root = [base + (i < extra) for i in range(model.layers)], []
    else:
        blocks, root = [model.block_params] * model.layers, [model.root_params]
    b = max(1, blocks_per_unit)
    return root + [sum(blocks[i:i + b]) for i in range(0, len(blocks), b)]


def plan_strategy(model: ModelSpec, dims: ParallelDims, config: ZeroConfig,
                  work: Workload | None = None, budget: int | None = None,
                  blocks_per_unit: int = 1) -> StrategyPlan:
    """Per-GPU bytes of ``config`` (its stage, recipe, offload and ZeRO++) on the layout
    ``dims``: the training state where the policy places it (the device's in
    ``weights``, ``grads`` and ``optimizer``; with offload the whole
    :class:`~zeroshard.plan.placement.Placement`), activations of ``work``, hpZ's
    secondary shards, bytes on the wire by level. ZeRO++'s quantized slots are those
    of :func:`unit_sizes` at ``blocks_per_unit``."""
    check_layout(dims, config)
    work = work or Workload()
    params = tp_counted(model, dims.tp)  # the split ones and, on every tp GPU, the whole
    shapes = model_shapes(model) if config.recipe.shaped_state else None
    placed = place(params, dims, config, model.trainable, shapes)
    units = (tp_unit_counts(model, dims.tp, unit_sizes(model, blocks_per_unit))
             if uses_zeropp(config) else None)
    levels = traffic(params, dims, config, units, model.trainable)
    # the optimizer's own exchanges (Muon's owner computes, Adafactor's sums): inside
    levels["inside"] += optimizer_comm(model_shapes(model), dims, config)
    kept = sum(kept_secondary(params, dims, config, units))
    recipe, device = config.recipe, placed.device
    return StrategyPlan(
        STRATEGIES[config.stage], device.weights, device.grads, device.optimizer,
        activation_bytes(model, recipe, work, dims.tp), sum(levels.values()),
        budget, dims.tp, tp_comm_bytes(model, recipe, work, dims.tp), dims.shard,
        levels["across"], placed.offload, placed if placed.offload else None, kept,
        levels.get("secondary", 0), config)


def generate_gather_bytes(model: ModelSpec, dims: ParallelDims, config: ZeroConfig) -> int:
    """What generating with the weights gathered once adds per GPU at stage 3
    (``ZeroConfig.generate_gather``: "whole"; [Note: generation] in ``runtime/cycle.py``):
    the full weights of this GPU's 1/tp in the compute dtype, held for the generation
    beside the training state (0 below stage 3, whose weights are whole already)."""
    check_layout(dims, config)
    if not config.policy.shards_params:
        return 0
    return ceil_div(tp_counted(model, dims.tp) * config.recipe.weight_bytes, dims.tp)


def plan_all(model: ModelSpec, dims: ParallelDims, config: ZeroConfig,
             work: Workload | None = None, budget: int | None = None,
             blocks_per_unit: int = 1) -> list[StrategyPlan]:
    """One :class:`StrategyPlan` per strategy, DDP first, each at the most of
    ``config``'s options its stage takes (``ZeroConfig.at_stage``)."""
    return [plan_strategy(model, dims, config.at_stage(s), work, budget, blocks_per_unit)
            for s in range(len(STRATEGIES))]
