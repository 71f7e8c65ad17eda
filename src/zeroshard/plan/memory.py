"""The memory and communication model: bytes per GPU by category, bytes on the wire.

Stage k shards the first k of (optimizer state, gradients, weights) over N ranks
(ZeRO paper, section 5). With the 2/2/12 recipe:

    DDP     16P            ZeRO-2  2P + 14P/N
    ZeRO-1  4P + 12P/N     ZeRO-3  16P/N

Communication per GPU per step uses ring accounting (ZeRO paper, section 7): an
all-reduce of T bytes sends 2(N-1)/N·T, a reduce-scatter or all-gather (N-1)/N·T.
DDP all-reduces the gradients; ZeRO-1/2 reduce-scatter them and all-gather the
updated weights; ZeRO-3 gathers the weights twice (forward and backward), so it moves
1.5× DDP's bytes when gradients and weights travel in the same dtype.

Activations are not sharded (each rank runs its own micro-batch). With the
architecture known they follow its family, output layer and loss included
(``plan/activations.py``). For a bare count with a width and depth, the source
documents' formula:

- with activation checkpointing, the layer inputs plus one layer's recompute:
  ``tokens·h·(L + 17)·bytes`` — L inputs of ``tokens·h`` elements, and Korthikanti
  et al.'s 34·tokens·h 16-bit bytes (= 17 elements) for the layer being recomputed,
  plus ``5·a·s·tokens`` when the heads are known and no flash kernel is used;
- without it, Korthikanti et al.'s per-layer ``tokens·h·(34 + 5·a·s/h)`` 16-bit bytes,
  or ``34·tokens·h`` when flash attention never stores the s×s scores.

Tensor parallelism of degree K (``tp``; Shoeybi et al., 2019, "Megatron-LM") splits
every layer's matrices over K GPUs, and ZeRO shards what each holds over the
data-parallel degree ``gpus / K``: weights, gradients and optimizer state are divided
by K before ZeRO divides them again. Activations follow Korthikanti et al. (2022,
eq. 3, tensor parallelism without sequence parallelism): per layer
``tokens·h·(10 + 24/K + 5·a·s/(h·K))`` 16-bit bytes, since the layer norms, dropouts
and layer inputs stay replicated. TP's own traffic is activations: two all-reduces of
``tokens·h`` elements in forward and two in backward per layer (the f and g operators
of Megatron-LM, fig. 4), and two more when checkpointing recomputes the forward. With
``tp = 1`` every formula is the one above, to the byte.

Hybrid sharding (``shard_group`` K; ``plan/comm.py``): stage k shards over groups of K
of the data-parallel ranks and replicates across the groups, so memory is the plain
figure at K ranks (floor 16P/K at stage 3) and the bytes split into two levels.
ZeRO++ (``zeropp``, :class:`~zeroshard.plan.comm.ZeroPP`): hpZ keeps K/K2 of every
unit's slots from its forward to its backward (``StrategyPlan.secondary``, counted in
``total``) and moves the backward's gathers to a third level, ``secondary``; qwZ and qgZ
send quantized bytes (``plan/comm.py``).

Every figure is an integer number of bytes; sharded figures round up (a rank holds
whole elements).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..spec.formulas import ceil_div
from ..spec.recipes import Recipe
from .activations import Saved, family_saved, korthikanti_saved
from .arch import ModelSpec
from .comm import (  # noqa: F401 - re-exported: the planner's communication model
    QUANT_BLOCK,
    ZeroPP,
    comm_bytes,
    comm_bytes_by_level,
    dp_degree,
    quantized_nbytes,
    ring_all_reduce,
    ring_one_way,
    secondary_bytes,
    shard_degree,
)

if TYPE_CHECKING:
    from .offload import Placement

STRATEGIES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")



@dataclass(frozen=True)
class Workload:
    """What one rank processes per micro-batch; drives the activation model."""

    tokens: int = 2048
    """Tokens per micro-batch per GPU (sequence length × micro-batch size)."""
    seq_len: int | None = None
    """Sequence length s for the attention term; None means ``tokens`` (batch 1)."""
    checkpointing: bool = True
    """Activation checkpointing: keep block inputs only, recompute in backward."""
    flash_attention: bool = False
    """Attention through a flash kernel: the s×s probabilities are never stored, in the
    forward nor in a checkpointed block's recompute."""
    checkpoint_every: int = 1
    """With checkpointing: every k-th block is checkpointed, the others keep everything
    (torchtitan's per-layer selective checkpointing); 1 is full checkpointing."""
    cpu: bool = False
    """The step runs on CPU: dropout keeps noise of the activation dtype, and attention
    with dropout takes the math path (``plan/activations.py``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or self.tokens <= 0:
            raise ValueError(f"tokens={self.tokens!r} must be a positive integer")
        if self.seq_len is not None:
            if not isinstance(self.seq_len, int) or self.seq_len <= 0:
                raise ValueError(f"seq_len={self.seq_len!r} must be a positive integer")
            if self.tokens % self.seq_len:
                raise ValueError(
                    f"tokens={self.tokens} is not a multiple of seq_len={self.seq_len}"
                )
        k = self.checkpoint_every
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"checkpoint_every={k!r} must be a positive integer")


def activation_saved(model: ModelSpec, recipe: Recipe, work: Workload,
                     tp: int = 1) -> Saved | None:
    """Activation bytes per GPU by when backward frees them (``plan/activations.py``):
    the family's model when the architecture is known (output layer and loss included),
    else the source documents' Korthikanti et al. constants; None when the shape is
    unknown."""
    if not model.activations_modelled:
        return None
    b, seq = recipe.activation_bytes, work.seq_len or work.tokens
    every = work.checkpoint_every if work.checkpointing else None
    if model.arch is not None:
        return family_saved(model.arch, b, work.tokens, seq, work.flash_attention, every, tp,
                            work.cpu)
    if every not in (None, 1):
        raise NotImplementedError("checkpointing every k-th block needs the architecture "
                                  "(a preset, --hf-config or dimensions)")
    return korthikanti_saved(model.hidden, model.layers, model.heads, b, work.tokens, seq,
                             work.flash_attention, work.checkpointing, tp)


def activation_bytes(model: ModelSpec, recipe: Recipe, work: Workload,
                     tp: int = 1) -> int | None:
    """Activation bytes per GPU at their peak (:attr:`Saved.peak` of
    :func:`activation_saved`); None when the shape is unknown."""
    saved = activation_saved(model, recipe, work, tp)
    return None if saved is None else saved.peak


def tp_comm_bytes(model: ModelSpec, recipe: Recipe, work: Workload, tp: int) -> int:
    """Bytes one GPU sends per micro-batch in TP's activation all-reduces: 4 per layer
    (6 with checkpointing's recomputed forward) of ``tokens·h`` elements over ``tp``."""
    if tp == 1:
        return 0
    if model.hidden is None or model.layers is None:
        raise ValueError("tensor parallelism needs the model's shape: give --hidden and --layers")
    per_layer = 6 if work.checkpointing else 4
    t = work.tokens * model.hidden * recipe.activation_bytes
    return model.layers * per_layer * ring_all_reduce(t, tp)


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
    """What this strategy keeps in host memory (``plan/offload.py``); ``weights``,
    ``grads`` and ``optimizer`` are then the device's bytes."""
    placement: Placement | None = None
    """With ``offload``: the :class:`~zeroshard.plan.offload.Placement` at the step."""
    secondary: int = 0
    """hpZ: bytes of every unit's secondary shards, held at the start of backward
    (K/K2 of the weights' K slots; the engine's ``gathered``); in ``total``."""
    comm_secondary: int = 0
    """Of ``comm``, the bytes of hpZ's backward gathers inside the secondary groups."""
    zeropp: ZeroPP | None = None
    """ZeRO++ as this strategy takes it (``ZeroPP.at``); None: none of it."""

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
            **(self.zeropp or ZeroPP()).as_dict(),
        }


def stage_of(strategy: str | int) -> int:
    """0–3 from a strategy name ("DDP", "ZeRO-2", "zero3", "2") or a stage number."""
    if isinstance(strategy, int) and 0 <= strategy <= 3:
        return strategy
    key = str(strategy).strip().lower().replace("-", "").replace("_", "")
    names = {"ddp": 0, "0": 0, "zero0": 0, "zero1": 1, "1": 1, "zero2": 2, "2": 2,
             "zero3": 3, "3": 3, "fsdp": 3}
    if key not in names:
        raise ValueError(
            f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)} or 0-3"
        )
    return names[key]


def model_state_bytes(params: int, gpus: int, recipe: Recipe, stage: int,
                      tp: int = 1, shard_group: int | None = None) -> tuple[int, int, int]:
    """(weights, grads, optimizer) bytes per GPU: stage k shards the first k of
    (optimizer, grads, weights) over ``gpus / tp`` ranks (or a shard group of K of
    them), after TP divides all by ``tp``."""
    k = shard_degree(gpus, tp, shard_group)

    def part(bytes_per_param: int, sharded: bool) -> int:
        total = ceil_div(bytes_per_param * params, tp)
        return ceil_div(total, k) if sharded else total

    return (
        part(recipe.weight_bytes, stage >= 3),
        part(recipe.grad_bytes, stage >= 2),
        part(recipe.optimizer_bytes, stage >= 1),
    )


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


def plan_strategy(
    model: ModelSpec,
    gpus: int,
    recipe: Recipe,
    strategy: str | int,
    work: Workload | None = None,
    budget: int | None = None,
    tp: int = 1,
    shard_group: int | None = None,
    offload: str | None = None,
    zeropp: ZeroPP | None = None,
    blocks_per_unit: int = 1,
    offload_dir: bool = False,
    sub_group_size: int | None = None,
) -> StrategyPlan:
    """Per-GPU bytes of one strategy on ``gpus`` GPUs (``gpus / tp`` data-parallel ranks,
    sharded over all of them or over groups of ``shard_group``); ``offload`` as far as
    the strategy takes it (none at stage 0, the optimizer's below stage 3). ``zeropp``
    (:class:`ZeroPP`) is refused where the stage cannot take it, as the engine does:
    :func:`plan_all` gives each strategy what it takes. Its quantized slots are those of
    :func:`unit_sizes` at ``blocks_per_unit``. ``offload_dir`` (with ``offload``): the
    master and the states in files, streamed in sub-groups of ``sub_group_size``
    elements (None: the engine's default), the placement's host bytes disk offload's."""
    from .offload import (  # builds on this module
        SUB_GROUP_SIZE,
        check_offload_dir,
        offload_at,
        placed_bytes,
    )
    if not isinstance(gpus, int) or gpus <= 0:
        raise ValueError(f"gpus={gpus!r} must be a positive integer")
    shard_degree(gpus, tp, shard_group)
    stage = stage_of(strategy)
    work = work or Workload()
    weights, grads, optimizer = model_state_bytes(model.params, gpus, recipe, stage, tp,
                                                  shard_group)
    check_offload_dir(offload_dir, offload)
    offload = offload_at(stage, offload)
    placed = None
    if offload:
        placed = placed_bytes(model.params, gpus, recipe, stage, offload, tp, shard_group,
                              offload_dir, sub_group_size or SUB_GROUP_SIZE)
        weights, grads, optimizer = placed.device.weights, placed.device.grads, 0
    units = unit_sizes(model, blocks_per_unit) if zeropp is not None and zeropp.active else None
    levels = comm_bytes_by_level(model.params, gpus, recipe, stage, shard_group, tp, zeropp,
                                 units)
    kept = sum(secondary_bytes(model.params, gpus, recipe, stage, shard_group, tp, zeropp,
                               units))
    return StrategyPlan(
        STRATEGIES[stage], weights, grads, optimizer,
        activation_bytes(model, recipe, work, tp), sum(levels.values()),
        budget, tp, tp_comm_bytes(model, recipe, work, tp), shard_group, levels["across"],
        offload, placed, kept, levels.get("secondary", 0),
        zeropp if zeropp is not None and zeropp.active else None,
    )


def plan_all(model, gpus, recipe, work=None, budget=None, tp=1,
             shard_group=None, offload=None, zeropp=None,
             blocks_per_unit=1, offload_dir=False,
             sub_group_size=None) -> list[StrategyPlan]:
    """One :class:`StrategyPlan` per strategy, DDP first; ``zeropp`` as far as each
    strategy takes it (:meth:`ZeroPP.at`); ``offload_dir`` where ``offload`` is taken."""
    return [plan_strategy(model, gpus, recipe, s, work, budget, tp, shard_group, offload,
                          None if zeropp is None else zeropp.at(s), blocks_per_unit,
                          offload_dir, sub_group_size)
            for s in range(4)]
