"""What a ZeRO stage means, decided once: the :class:`ShardPolicy`.

[Note: policy] Stage k shards the first k of (optimizer state, gradients, parameters)
across the shard group (ZeRO paper, section 5). Everything else the engine does
follows from which of the three are sharded:

| stage | shards       | full gradients after a reduction | reduction      | after the step |
|-------|--------------|----------------------------------|----------------|----------------|
| 0     | —            | the average (DDP)                | all-reduce     | cast           |
| 1     | optimizer    | the local sum, kept and reduced again | reduce-scatter | all-gather |
| 2     | + gradients  | freed once packed                | reduce-scatter | all-gather     |
| 3     | + parameters | freed once packed                | reduce-scatter | cast (into the shard) |

The policy is derived from the :class:`~zeroshard.spec.config.ZeroConfig` at
``zs.shard`` time and handed to every unit; the units, the reduction scheduler, the
ledger, clipping and checkpoints ask it, and nothing else compares stage numbers. A
new mode (a placement, a second level of group) is a field here plus the few places
that act on it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

#: The categories of training state a stage may shard, in the order stages add them.
SHARDABLE = ("optimizer", "grads", "params")


class FullGrads(enum.Enum):
    """What a unit's full (unsharded) gradients hold after a synchronised backward."""

    AVERAGED = "averaged"
    """Stage 0: the average over ranks replaces the local gradients (torch DDP); the
    next backward of the same cycle adds to it."""
    LOCAL = "local"
    """Stage 1: the local sum over the cycle's backwards, kept; it is reduced again
    after each synchronised backward and the last reduction counts."""
    FREED = "freed"
    """Stages 2-3: freed as soon as they are packed into the communication buffer; the
    reduced shard accumulates over the cycle instead."""


class AfterStep(enum.Enum):
    """How the compute weights catch up with the updated shards after the step."""

    CAST = "cast"
    """This rank alone: the compute weights are the updated shard (fp32), or a cast of
    the master into them (full weights at stage 0, the weight shard at stage 3)."""
    ALL_GATHER = "all_gather"
    """Stages 1-2: every rank's updated rows are all-gathered into the full weights."""


@dataclass(frozen=True)
class ShardPolicy:
    """The answers to every question the engine asks about a stage."""

    stage: int
    """The ZeRO stage this policy was derived from (0-3); for reports only."""
    sharded: frozenset[str]
    """Which of ``SHARDABLE`` are sharded across the shard group."""
    placement: tuple[tuple[str, str], ...] = (("params", "device"), ("grads", "device"),
                                              ("optimizer", "device"))
    """Where each category lives: ``"device"`` (the rank's accelerator, the CPU on a
    machine without one), ``"host"`` (offloaded: separate host buffers, pinned under
    CUDA, even where the device is the CPU itself) or, for the optimizer, ``"disk"``
    (files under ``offload_dir``, streamed through host memory by the step)."""
    offload_dir: str | None = None
    """Disk offload: the directory the optimizer's files go under."""
    sub_group_size: int = 0
    """Disk offload: elements of the optimizer partition stepped at once."""

    @classmethod
    def for_stage(cls, stage: int) -> ShardPolicy:
        """Stage k shards the first k of ``SHARDABLE``."""
        if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
            raise ValueError(f"stage={stage!r} is not a ZeRO stage; expected 0, 1, 2 or 3")
        return cls(stage, frozenset(SHARDABLE[:stage]))

    @classmethod
    def from_config(cls, config) -> ShardPolicy:
        """The stage's policy, with what ``config.offload`` moves to the host."""
        policy = cls.for_stage(config.stage)
        host = {"optimizer": ("optimizer",), "params": ("optimizer", "params")}.get(
            config.offload, ())
        disk = config.offload_dir is not None

        def place(c: str, where: str) -> str:
            if c not in host:
                return where
            return "disk" if disk and c == "optimizer" else "host"

        return replace(policy, placement=tuple((c, place(c, w)) for c, w in policy.placement),
                       offload_dir=config.offload_dir,
                       sub_group_size=config.sub_group_size if disk else 0)

    def whole_params(self) -> ShardPolicy:
        """The same policy with the parameters kept whole on every rank: the unit of
        parameters below ``param_persistence_threshold`` inside a stage-3 model."""
        return replace(self, sharded=self.sharded - {"params"})

    # -- what is sharded ------------------------------------------------------------
    @property
    def shards_optimizer(self) -> bool:
        """Master weights and optimizer state: rank r keeps its rows only."""
        return "optimizer" in self.sharded

    @property
    def shards_grads(self) -> bool:
        """Stored gradients: rank r keeps the reduced rows of its own shard only."""
        return "grads" in self.sharded

    @property
    def shards_params(self) -> bool:
        """Compute weights: only the shard between uses; gathered for forward and
        backward, released after (FSDP)."""
        return "params" in self.sharded

    def shard_coords(self, dp_rank: int, dp_world: int) -> tuple[int, int]:
        """``(rank, world)`` within the group the optimizer state is sharded over:
        the data-parallel group, or a group of one when nothing is sharded."""
        return (dp_rank, dp_world) if self.shards_optimizer else (0, 1)

    def where(self, category: str) -> str:
        """Where ``category`` lives (see ``placement``)."""
        return dict(self.placement)[category]

    @property
    def offloads_optimizer(self) -> bool:
        """The master and optimizer state live off the device (host or disk): a master
        copy exists even in fp32, and the step's gradients go to the host."""
        return self.where("optimizer") in ("host", "disk")

    @property
    def optimizer_on_disk(self) -> bool:
        """The master and optimizer state live in files; the step streams them."""
        return self.where("optimizer") == "disk"

    @property
    def shards_anything(self) -> bool:
        """Some category is sharded: a shard group smaller than the data-parallel ranks
        changes something (stage 0 in groups holds what DDP holds and sends more)."""
        return bool(self.sharded)

    # -- gradients ------------------------------------------------------------------
    @property
    def full_grads(self) -> FullGrads:
        if self.shards_grads:
            return FullGrads.FREED
        return FullGrads.LOCAL if self.shards_optimizer else FullGrads.AVERAGED

    @property
    def reduce(self) -> str:
        """The gradient collective: ``"all_reduce"`` when every rank keeps every full
        gradient, else ``"reduce_scatter"`` (each rank receives its slot)."""
        return "all_reduce" if self.full_grads is FullGrads.AVERAGED else "reduce_scatter"

    @property
    def keeps_full_grads(self) -> bool:
        """Full gradients live from backward to the step (and count as ``grads``)."""
        return self.full_grads is not FullGrads.FREED

    @property
    def keeps_local_grads(self) -> bool:
        """Stage 1: the full gradients hold this rank's local sum and stay to the step,
        added to by every backward of the cycle; each synchronised backward reduces
        them again into a slot of its own rows beside them (the slot replaced, not
        added to)."""
        return self.full_grads is FullGrads.LOCAL

    @property
    def averages_grads(self) -> bool:
        """Stage 0: the reduction's average comes back into the full gradients (an
        all-reduce, no slot of this rank's own)."""
        return self.full_grads is FullGrads.AVERAGED

    @property
    def frees_grads_when_packed(self) -> bool:
        """The local full gradients go as soon as the reduction is issued: stages 2-3
        keep none, stage 0 gets the average back in fresh storage."""
        return self.full_grads is not FullGrads.LOCAL

    def bounds_reductions(self, grad_itemsize: int, reduce_itemsize: int) -> bool:
        """Whether at most two reductions may be in flight. Stage 0 in the gradients'
        own dtype needs no bound: its local gradients are freed as its buffer is filled
        and the buffer is freed as the average lands, so the buffers in flight hold
        what the gradients would. Summed in a wider dtype they hold more."""
        return (self.full_grads is not FullGrads.AVERAGED
                or reduce_itemsize > grad_itemsize)

    # -- after the step -------------------------------------------------------------
    @property
    def after_step(self) -> AfterStep:
        return (AfterStep.ALL_GATHER if self.shards_optimizer and not self.shards_params
                else AfterStep.CAST)

    @property
    def gathers_after_step(self) -> bool:
        """Stages 1-2: every rank's updated rows are all-gathered into the full weights
        after the step (one gather of the weights a step, none in forward or backward)."""
        return self.after_step is AfterStep.ALL_GATHER

    @property
    def checks_elementwise(self) -> bool:
        """The optimizer must update each element alone: it steps slices."""
        return self.shards_optimizer

    def as_dict(self) -> dict:
        """The answers as plain data (the planner's page reads them instead of comparing
        stage numbers): what is sharded, the reduction, what the full gradients hold,
        what follows the step, where each category lives."""
        return {"stage": self.stage,
                "shards": {c: c in self.sharded for c in SHARDABLE},
                "reduce": self.reduce, "full_grads": self.full_grads.value,
                "keeps_full_grads": self.keeps_full_grads,
                "after_step": self.after_step.value, "placement": dict(self.placement)}
