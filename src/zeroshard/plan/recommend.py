"""``zeroshard plan --recommend``: the configuration to run, and why.

Every combination of stage (0–3), tensor-parallel degree, blocks per unit (1, 2, 4),
stage-3 prefetch depth (0, 1, 2) and activation checkpointing is given the largest
micro-batch that fits; the survivors are ranked by the step-time model. The source
documents' stage-selection guide is encoded as rules on top of that ranking:

- **fits with headroom**: the planned peak (``peak.peak``: the loss's backward with
  every activation and the logits' gradients, the largest unit's backward — the root
  unit's or a block group's — and the optimizer step with its fp32 gradient copies and
  temporaries) stays within the budget less :data:`HEADROOM` (the first source
  document: leave 10–20 % for fragmentation);
- **lowest stage first**: DDP if it fits, else ZeRO-1 or 2 (same traffic as DDP), else
  ZeRO-3 — a higher stage, deeper prefetch, larger TP degree or checkpointing is chosen
  only when it is more than :data:`TIE` faster than the simpler configuration;
- **one block per unit** unless coarser units are faster (the first source document:
  wrap per transformer block);
- **tensor parallelism inside a node only** (the third source document: TP needs
  NVLink; at most ``gpus_per_node``), and only when the heads divide by it.

Micro-batches are whole sequences; the global batch (sequences per optimizer step)
must divide by the data-parallel degree times the micro-batch, the rest being gradient
accumulation steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .advice import gpu_counts
from .arch import ModelSpec
from .hardware import Cluster
from .memory import STRATEGIES, Workload
from .peak import peak
from .recipes import Recipe
from .steptime import Schedule, StepTime, step_time

#: Fraction of GPU memory left free (fragmentation, allocator, workspaces).
HEADROOM = 0.10
#: A more complex configuration must beat a simpler one by more than this fraction.
TIE = 0.01
BLOCKS_PER_UNIT = (1, 2, 4)
PREFETCH = (0, 1, 2)
TP_DEGREES = (1, 2, 4, 8)


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
    checkpointing: bool
    """Activation checkpointing."""
    micro_batch: int
    """Sequences per GPU per forward."""
    accumulation: int
    """Micro-batches per optimizer step."""
    memory: int
    """Peak bytes per GPU: persistent state, activations and transient buffers."""
    time: StepTime
    """The step-time model's prediction."""

    @property
    def strategy(self) -> str:
        return STRATEGIES[self.stage]

    @property
    def key(self) -> tuple:
        """How much machinery it needs, least first (the rule order of the module)."""
        return (self.stage, self.tp, self.checkpointing, self.prefetch,
                self.blocks_per_unit != 1, self.blocks_per_unit, -self.micro_batch)

    def as_dict(self) -> dict:
        return {"strategy": self.strategy, "stage": self.stage, "tp": self.tp,
                "blocks_per_unit": self.blocks_per_unit, "prefetch": self.prefetch,
                "checkpointing": self.checkpointing, "micro_batch": self.micro_batch,
                "accumulation": self.accumulation, "memory": self.memory,
                "time": self.time.as_dict()}


@dataclass(frozen=True)
class Recommendation:
    """The chosen configuration, a reason per choice, and the runners-up."""

    best: Candidate | None
    """None when nothing fits; ``reasons["none"]`` says why."""
    reasons: dict[str, str] = field(default_factory=dict)
    """One sentence per choice: stage, tp, unit size, prefetch, checkpointing, micro-batch."""
    runners_up: tuple[Candidate, ...] = ()
    """The fastest configuration of each other (stage, tp, checkpointing), fastest first."""
    budget: int = 0
    """GPU memory in bytes; configurations use at most (1 - headroom) of it."""
    headroom: float = HEADROOM
    """The fraction of ``budget`` left free."""
    notes: tuple[str, ...] = ()
    """What zeroshard cannot run but the source documents advise (hybrid sharding)."""

    def as_dict(self) -> dict:
        return {"best": self.best.as_dict() if self.best else None, "reasons": self.reasons,
                "runners_up": [c.as_dict() for c in self.runners_up], "budget": self.budget,
                "headroom": self.headroom, "notes": list(self.notes)}


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def _memory(model, recipe, gpus, tp, stage, work, blocks, prefetch, micro_batches=1) -> int:
    """The planned peak (``peak.peak``): the loss's backward with its logits' gradients,
    a unit's backward with the root unit's or a block group's transients, the step."""
    return peak(model, recipe, work, gpus, stage, prefetch, blocks, tp, micro_batches).bytes


def search(model: ModelSpec, recipe: Recipe, gpus: int, budget: int, cluster: Cluster,
           global_batch: int, seq_len: int, flash_attention: bool = False,
           tp: int | None = None, prefetch: int | None = None, headroom: float = HEADROOM):
    """(every fitting candidate, the smallest need per stage, the TP degrees tried)."""
    if model.hidden is None or model.layers is None:
        raise ValueError("--recommend needs the model's shape: give --hidden and --layers "
                         "(or a preset)")
    if tp is not None:
        tps = [tp]
    else:
        tps = [k for k in TP_DEGREES if k <= cluster.gpus_per_node and gpus % k == 0
               and (model.heads is None or model.heads % k == 0)]
    limit = int(budget * (1 - headroom))
    found, need = [], {}
    for k in tps:
        dp = gpus // k
        if gpus % k or global_batch % dp:
            continue
        per_rank = global_batch // dp
        for stage in range(4):
            depths = (PREFETCH if prefetch is None else (prefetch,)) if stage == 3 else (0,)
            for ckpt in (False, True):
                for blocks in BLOCKS_PER_UNIT:
                    if blocks > model.layers:
                        continue
                    for depth in depths:
                        for micro in _divisors_desc(per_rank):
                            work = Workload(micro * seq_len, seq_len, ckpt, flash_attention)
                            mem = _memory(model, recipe, gpus, k, stage, work, blocks, depth,
                                          per_rank // micro)
                            need[stage] = min(need.get(stage, mem), mem)
                            if mem <= limit:
                                sched = Schedule(stage, blocks, depth, per_rank // micro, k)
                                found.append(Candidate(
                                    stage, k, blocks, depth, ckpt, micro, per_rank // micro,
                                    mem, step_time(model, recipe, work, gpus, cluster, sched)))
                                break
    return found, need, tps


def choose(found: list[Candidate]) -> Candidate:
    """The simplest candidate (by :attr:`Candidate.key`) within TIE of the fastest."""
    fastest = min(c.time.step for c in found)
    close = [c for c in found if c.time.step <= fastest * (1 + TIE)]
    return min(close, key=lambda c: c.key)


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB"


def _pct(c: Candidate, best: Candidate) -> str:
    return f"{(c.time.step / best.time.step - 1) * 100:+.1f}%"


def _best_where(found, **fixed) -> Candidate | None:
    pool = [c for c in found if all(getattr(c, k) == v for k, v in fixed.items())]
    return min(pool, key=lambda c: (c.time.step, c.key)) if pool else None


def _reasons(best: Candidate, found, need, tps, limit, global_batch, seq_len,
             headroom: float) -> dict:
    b = best
    others = []
    for s in range(4):
        if s == b.stage:
            continue
        alt = _best_where(found, stage=s)
        others.append(f"{STRATEGIES[s]} " + (f"{_pct(alt, b)} at best" if alt else
                                             f"does not fit (needs {_gb(need[s])} or more)"))
    why = {"stage": (f"{b.strategy}: the lowest stage within {TIE:.0%} of the fastest that "
                     f"fits {_gb(limit)} ({headroom:.0%} headroom); " + "; ".join(others))}
    alts = [f"TP {k} " + (f"{_pct(a, b)}" if (a := _best_where(found, stage=b.stage, tp=k))
                          else "does not fit") for k in tps if k != b.tp]
    why["tp"] = (f"{b.tp}: " + ("no tensor parallelism; " if b.tp == 1 else
                                f"{b.tp}-way inside a node, its all-reduces never hidden "
                                f"({b.time.tp_comm:.3f} s per step); ")
                 + (", ".join(alts) if alts else "the only degree tried"))
    alts = [f"{k} {_pct(a, b)}" for k in BLOCKS_PER_UNIT if k != b.blocks_per_unit
            and (a := _best_where(found, stage=b.stage, tp=b.tp, prefetch=b.prefetch,
                                  checkpointing=b.checkpointing, blocks_per_unit=k))]
    why["unit size"] = (f"{b.blocks_per_unit} block(s) per unit: one gather and one "
                        "reduction per unit; finer units pay the latency α more often, "
                        "coarser ones hold more transient memory and expose a bigger first "
                        "gather" + (f"; {', '.join(alts)}" if alts else ""))
    if b.stage == 3:
        alts = [f"{d} {_pct(a, b)}" for d in PREFETCH if d != b.prefetch
                and (a := _best_where(found, stage=3, tp=b.tp, checkpointing=b.checkpointing,
                                      blocks_per_unit=b.blocks_per_unit, prefetch=d))]
        why["prefetch"] = (f"{b.prefetch}: gathers exposed {b.time.exposed:.3f} s per step; "
                           "each unit of depth holds one more gathered unit"
                           + (f"; {', '.join(alts)}" if alts else ""))
    else:
        why["prefetch"] = "n/a: below stage 3 the weights are whole, nothing is gathered"
    alt = _best_where(found, stage=b.stage, tp=b.tp, checkpointing=not b.checkpointing)
    if b.checkpointing:
        why["checkpointing"] = ("on: recomputing the forward costs a third more compute, "
                                "but " + (f"without it the best is {_pct(alt, b)} "
                                          f"(micro-batch {alt.micro_batch})" if alt else
                                          "without it even one sequence does not fit"))
    else:
        why["checkpointing"] = ("off: the activations fit, so no forward is recomputed"
                                + (f"; with it {_pct(alt, b)}" if alt else ""))
    why["micro-batch"] = (f"{b.micro_batch} sequence(s) of {seq_len} tokens per GPU, "
                          f"{b.accumulation} accumulation step(s): the largest that fits "
                          f"({_gb(b.memory)} per GPU) for {global_batch} sequences over "
                          f"{global_batch // (b.micro_batch * b.accumulation)} data-parallel "
                          "ranks; fewer passes mean fewer reductions (the engine reduces "
                          "after every backward)")
    return why


def hybrid_note(model, recipe, gpus, cluster, best: Candidate, seq_len: int,
                limit: int, flash_attention: bool = False) -> str | None:
    """When ZeRO-3 spans nodes: the smallest shard group whose ZeRO-3 memory fits (the
    first source document: shard within a group, replicate across groups, and size the
    group so that 16P/N_group fits)."""
    if best.stage != 3 or gpus <= cluster.gpus_per_node:
        return None
    dp = gpus // best.tp
    work = Workload(best.micro_batch * seq_len, seq_len, best.checkpointing,
                    flash_attention)
    for group in (g for g in range(1, dp) if dp % g == 0):  # a proper subgroup
        mem = _memory(model, recipe, group * best.tp, best.tp, 3, work, best.blocks_per_unit,
                      best.prefetch, best.accumulation)
        if mem <= limit:
            span = group * best.tp
            where = ("inside one node" if span <= cluster.gpus_per_node else
                     f"across {-(-span // cluster.gpus_per_node)} nodes")
            return (f"hybrid sharding (not in zeroshard): ZeRO-3 over groups of {group} ranks "
                    f"would need {_gb(mem)}, its gathers {where}, replicas all-reducing "
                    "gradients across groups")
    return None


def _fewest_gpus(model, recipe, limit: int, work: Workload) -> int | None:
    """The fewest whole 8-GPU nodes (or 1) at which ZeRO-3's planned peak with
    ``work`` fits ``limit``; the peak never grows with N, so a binary search."""
    counts = gpu_counts(8)
    fits = lambda i: peak(model, recipe, work, counts[i], 3).bytes <= limit  # noqa: E731
    if not fits(len(counts) - 1):
        return None
    lo, hi = 0, len(counts) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return counts[lo]


def recommend(model: ModelSpec, recipe: Recipe, gpus: int, budget: int, cluster: Cluster,
              global_batch: int, seq_len: int, flash_attention: bool = False,
              tp: int | None = None, prefetch: int | None = None,
              runners_up: int = 5, headroom: float = HEADROOM) -> Recommendation:
    """The recommended configuration for ``global_batch`` sequences of ``seq_len``,
    leaving ``headroom`` (a fraction) of each GPU's memory free."""
    for name, v in (("gpus", gpus), ("global_batch", global_batch), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom={headroom!r} must be a fraction in [0, 1)")
    found, need, tps = search(model, recipe, gpus, budget, cluster, global_batch, seq_len,
                              flash_attention, tp, prefetch, headroom)
    limit = int(budget * (1 - headroom))
    dps = sorted({gpus // k for k in tps}, reverse=True)
    if all(global_batch % d for d in dps):
        raise ValueError(f"global batch of {global_batch} sequences does not divide over "
                         f"{' or '.join(map(str, dps))} data-parallel ranks")
    if not found:
        fewest = _fewest_gpus(model, recipe, limit, Workload(seq_len, seq_len, True,
                                                             flash_attention))
        why = (f"nothing fits {_gb(limit)} per GPU ({headroom:.0%} headroom) on {gpus} "
               f"GPUs: even ZeRO-3 with checkpointing and one sequence needs "
               f"{_gb(need.get(3, 0))}; " + (
                   f"its peak fits from {fewest} GPUs"
                   if fewest else "no GPU count fits; shorten the sequences")
               + (" (--headroom sets the share left free)" if headroom else ""))
        return Recommendation(None, {"none": why}, (), budget, headroom)
    best = choose(found)
    # the fastest of each other (stage, tp, checkpointing): alternatives, not near-copies
    group = lambda c: (c.stage, c.tp, c.checkpointing)  # noqa: E731
    heads: dict[tuple, Candidate] = {}
    for c in sorted(found, key=lambda c: (c.time.step, c.key)):
        if group(c) != group(best):
            heads.setdefault(group(c), c)
    note = hybrid_note(model, recipe, gpus, cluster, best, seq_len, limit, flash_attention)
    return Recommendation(best, _reasons(best, found, need, tps, limit, global_batch, seq_len,
                                         headroom),
                          tuple(list(heads.values())[:runners_up]), budget, headroom,
                          (note,) if note else ())
