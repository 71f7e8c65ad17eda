"""The configurations ``zeroshard plan --recommend`` weighs, and those that fit.

Every combination of stage (0–3), tensor-parallel degree, shard group (plain, or hybrid
sharding in groups of whole nodes), blocks per unit (1, 2, 4), stage-3 prefetch depth
(0, 1, 2) and activation checkpointing (none, selective, full: the least recompute
first) is given the largest micro-batch whose planned
peak (``peak.peak``: the loss's backward with every activation and the logits'
gradients, each unit's backward with the reductions in flight, the end of backward, and
the optimizer step with its buffers and temporaries) stays within the budget less
:data:`HEADROOM` (the first source document: leave 10–20 % for fragmentation), and
timed by the step-time model. Micro-batches are whole sequences; the global batch
(sequences per optimizer step) must divide by the data-parallel degree times the
micro-batch, the rest being gradient accumulation steps. ``recommend.py`` chooses among
them.

- **tensor parallelism inside a node only** (the third source document: TP needs
  NVLink; at most ``gpus_per_node``), and only when the heads divide by it;
- **hybrid sharding in groups of whole nodes** (the first source document: shard within
  a node, replicate across nodes; FSDP2's HSDP, DeepSpeed's MiCS): stages 1–3 over
  groups of K data-parallel ranks that fill 1, 2, 4, … nodes, K a proper divisor of the
  ranks (stage 0 in groups holds what DDP holds and sends more: it is not tried);
- **offload** (``plan/placement.py``) only where the configuration asks for it: the
  stages that take it, with it; on disk (the policy's placement) only where asked too:
  the same device peaks, the streamed step's time.

The search reads one ``ZeroConfig`` for the precision, the offload and its placement,
and a fixed shard group (``shard_group``: K, or ``"node"``); each candidate is that
configuration at its stage, prefetch depth and shard group (``Candidate.config``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..spec.config import ZeroConfig
from ..spec.dims import ParallelDims
from ..spec.policy import ShardPolicy
from .arch import ModelSpec
from .hardware import Cluster
from .layout import stages_taking
from .memory import STRATEGIES, Workload
from .peak import peak
from .reasons import BLOCKS_PER_UNIT, PREFETCH
from .steptime import Schedule, StepTime, step_time

#: Fraction of GPU memory left free (fragmentation, allocator, workspaces).
HEADROOM = 0.10
TP_DEGREES = (1, 2, 4, 8)
__all__ = ["HEADROOM", "TP_DEGREES", "Candidate", "search", "shard_groups"]


@dataclass(frozen=True)
class Candidate:
    """One configuration that fits, with its memory and predicted time."""

    stage: int
    """ZeRO stage 0-3."""
    tp: int
    """Tensor-parallel degree."""
    blocks_per_unit: int
    """Transformer blocks per unit."""
    prefetch: int
    """Stage-3 prefetch depth (0 below stage 3: nothing is gathered before use)."""
    checkpointing: str
    """Activation checkpointing, one of :data:`CHECKPOINTING` (``ZeroConfig.
    activation_checkpointing``'s modes)."""
    micro_batch: int
    """Sequences per GPU per forward."""
    accumulation: int
    """Micro-batches per optimizer step."""
    memory: int
    """Peak bytes per GPU: persistent state, activations and transient buffers."""
    time: StepTime
    """The step-time model's prediction."""
    shard_group: int | None = None
    """Hybrid sharding: data-parallel ranks per shard group (None: plain, over all)."""
    dp: int = 0
    """Data-parallel ranks (GPUs / tp)."""
    offload: str | None = None
    """What lives in host memory (``plan/placement.py``), None: nothing."""
    offload_dir: bool = False
    """The offloaded master and optimizer state live in files (disk offload)."""
    config: ZeroConfig | None = None
    """The configuration it runs (stage, prefetch, shard group, offload, precision)."""

    @property
    def strategy(self) -> str:
        return STRATEGIES[self.stage]

    @property
    def policy(self) -> ShardPolicy:
        """What its stage shards."""
        return ShardPolicy.for_stage(self.stage)

    @property
    def dims(self) -> ParallelDims:
        """Its layout: ``dp · tp`` GPUs, the shard group."""
        return ParallelDims(self.dp * self.tp, self.tp, self.shard_group)

    @property
    def group_gpus(self) -> int | None:
        """GPUs a shard group spans (K·tp), None when plain: the same layout at any TP."""
        return None if self.shard_group is None else self.shard_group * self.tp

    @property
    def key(self) -> tuple:
        """How much machinery it needs, least first (the rule order of ``recommend.py``)."""
        return (self.offload is not None, self.offload == "params", self.stage, self.tp,
                self.shard_group is not None, CHECKPOINTING.index(self.checkpointing),
                self.prefetch, self.blocks_per_unit != 1, self.blocks_per_unit,
                -self.micro_batch)

    def as_dict(self) -> dict:
        return {"strategy": self.strategy, "stage": self.stage, "tp": self.tp,
                "shard_group": self.shard_group, "offload": self.offload,
                "blocks_per_unit": self.blocks_per_unit, "prefetch": self.prefetch,
                "offload_dir": self.offload_dir,
                "checkpointing": self.checkpointing, "micro_batch": self.micro_batch,
                "accumulation": self.accumulation, "memory": self.memory,
                "time": self.time.as_dict()}


#: The checkpointing modes weighed, the least recomputed first (``Candidate.key``): none,
#: selective (attention's core again), full (a whole forward again).
CHECKPOINTING = ("none", "selective", "full")


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def shard_groups(gpus: int, tp: int, cluster: Cluster) -> list[int]:
    """Hybrid shard groups worth trying at ``tp``: the data-parallel ranks of 1, 2, 4, …
    whole nodes, each a proper divisor of the ranks (a group of all is plain)."""
    dp, per_node = gpus // tp, max(1, cluster.gpus_per_node // tp)
    out, k = [], per_node
    while k < dp:
        if dp % k == 0:
            out.append(k)
        k *= 2
    return out


def search(model: ModelSpec, config: ZeroConfig, gpus: int, budget: int, cluster: Cluster,
           global_batch: int, seq_len: int, flash_attention: bool = False,
           tp: int | None = None, prefetch: int | None = None, headroom: float = HEADROOM,
           checkpointing: str | None = None):
    """(every fitting candidate, the smallest need per (stage, tp, shard group), the TP
    degrees tried, the hybrid shard groups tried per TP degree). ``config``: the
    precision, the offload and where (only the stages that take it are tried), and
    ``shard_group``: None weighs plain sharding and :func:`shard_groups`; K that group
    only, at the TP degrees whose data-parallel ranks it divides (all the ranks: plain
    only); ``"node"`` a node's data-parallel ranks at each degree. Its stage and
    prefetch are what the search varies (``prefetch`` given: that depth only), and the
    checkpointing (``checkpointing`` given, one of :data:`CHECKPOINTING`: that mode
    only)."""
    if checkpointing is not None and checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing={checkpointing!r}: the search weighs "
                         f"{', '.join(CHECKPOINTING)}")
    modes = CHECKPOINTING if checkpointing is None else (checkpointing,)
    if model.hidden is None or model.layers is None:
        raise ValueError("--recommend needs the model's shape: give --hidden and --layers "
                         "(or a preset)")
    if tp is not None:
        tps = [tp]
    else:
        tps = [k for k in TP_DEGREES if k <= cluster.gpus_per_node and gpus % k == 0
               and (model.heads is None or model.heads % k == 0)]
    limit = int(budget * (1 - headroom))
    shard_group = config.shard_group
    if isinstance(shard_group, int) and not any(
            gpus % k == 0 and (gpus // k) % shard_group == 0 for k in tps):
        ParallelDims(gpus, tps[0], shard_group)  # names the ranks it does not divide
    found, need, groups = [], {}, {}
    for k in tps:
        dp = gpus // k
        if gpus % k or global_batch % dp:
            continue
        fixed = max(1, cluster.gpus_per_node // k) if shard_group == "node" else shard_group
        if fixed is not None and dp % fixed:
            continue  # a group that does not divide these ranks
        if fixed is None:
            groups[k] = shard_groups(gpus, k, cluster)
        elif fixed < dp:
            groups[k] = [fixed]
        per_rank = global_batch // dp
        for staged in stages_taking(replace(config, shard_group=None)):
            hybrid = groups.get(k, []) if staged.policy.shards_anything else []
            plain = [None] if fixed is None or fixed == dp else []
            for group in plain + hybrid:
                found += _fits(model, staged, gpus, cluster, k, group, per_rank, seq_len,
                               flash_attention, prefetch, limit, need, modes)
    return found, need, tps, groups


def _fits(model, config, gpus, cluster, tp, group, per_rank, seq_len, flash, prefetch,
          limit, need, modes=CHECKPOINTING) -> list[Candidate]:
    """The candidates of one (tp, stage, shard group): per checkpointing, unit size and
    depth, the largest micro-batch whose planned peak (``peak.peak``: the loss's
    backward with its logits' gradients, each unit's backward with the reductions in
    flight, the step with its buffers) fits ``limit``; ``need`` keeps the least any of
    them needs."""
    out = []
    policy = config.policy
    depths = (PREFETCH if prefetch is None else (prefetch,)) if policy.shards_params else (0,)
    dims = ParallelDims(gpus, tp, group)
    for ckpt in modes:
        for blocks in BLOCKS_PER_UNIT:
            if blocks > model.layers:
                continue
            for depth in depths:
                at = replace(config, prefetch=depth, shard_group=group)
                for micro in _divisors_desc(per_rank):
                    work = Workload.of_mode(micro * seq_len, seq_len, ckpt,
                                            flash_attention=flash)
                    acc = per_rank // micro
                    mem = peak(model, dims, at, work, blocks, acc).bytes
                    key = (config.stage, tp, group)
                    need[key] = min(need.get(key, mem), mem)
                    if mem <= limit:
                        out.append(Candidate(
                            config.stage, tp, blocks, depth, ckpt, micro, acc, mem,
                            step_time(model, dims, at, work, cluster, Schedule(blocks, acc)),
                            group, gpus // tp, config.offload, policy.optimizer_on_disk, at))
                        break
    return out
