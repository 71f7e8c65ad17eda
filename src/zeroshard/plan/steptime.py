"""The step-time model: compute, communication, and how much of it the engine hides.

**Compute.** A training step of a decoder-only transformer costs, per token, the forward
``2·P + 4·L·h·s`` FLOPs (every weight once in a multiply-add; the attention scores
``QKᵀ`` and the weighted sum over ``s`` positions) and twice that in backward: ``6·P +
12·L·h·s`` in all (Kaplan et al., 2020, table 1; Narayanan et al., 2021, section 5.1,
whose ``72·B·s·L·h²·(1 + s/6h + …)`` has the same attention term). Activation
checkpointing runs the forward again inside backward: ``8·P + 16·L·h·s``. Tensor
parallelism of degree K gives each GPU 1/K of those FLOPs. Time = FLOPs / (peak ×
efficiency).

**Communication** (alpha-beta model of a ring; Thakur, Rabenseifner and Gropp, 2005;
Patarasuk and Yuan, 2009): over n ranks, a reduce-scatter or all-gather of T bytes takes
``(n-1)·α + (n-1)/n·T/β``, an all-reduce twice that. β and α are those of the slowest
network level the ring spans (:meth:`Cluster.link`).

**Overlap, as zeroshard's engine schedules it** (``runtime/sharded.py``): one serial
link carries the data-parallel collectives in issue order; the compute stream waits on
them only where the engine waits:

- every stage reduces each unit's gradients as soon as its backward is done, in
  reverse forward order — stages 1–3 with at most two reductions in flight (issuing a
  third waits for the oldest), stage 0 without a bound — so reductions hide behind the
  backward of the units still to come;
  the next micro-batch's backward waits for all of them, and the step waits for the
  last: the last reduction is exposed;
- stage 3 gathers each unit before its forward and again before its backward and
  issues the next ``prefetch`` units' gathers as soon as its own has landed; the first
  gather of each pass is exposed, and with ``prefetch`` 0 every gather is;
- stages 1–2 all-gather the updated weights after the optimizer step, unit by unit, two
  in flight; the step's hook waits for all but the last and the next forward for that
  one, so these gathers are exposed;
- the optimizer step streams its shard of optimizer state, weights and gradients once
  (``2·(optimizer + weights) + grads`` bytes per parameter it owns) at the memory rate;
- TP's activation all-reduces sit between a layer's matrix multiplies: never hidden.

On a network marked ``overlap=False`` (gloo on a CPU, where the transfers run on the
cores that compute) nothing hides: the step is compute + TP + optimizer + every
collective.

The model's units are the L layers grouped ``blocks_per_unit`` at a time, holding P/U
parameters each (the embeddings and head are spread over them). Steady state repeats
each micro-batch, so a step of A micro-batches is simulated for min(A, 3) and the last
micro-batch's increment repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

from .arch import ModelSpec
from .hardware import Cluster, Link
from .memory import STRATEGIES, Workload, dp_degree
from .recipes import Recipe

#: Micro-batches simulated before the steady-state increment is repeated.
SIMULATED = 3


def ring_time(kind: str, nbytes: float, ranks: int, link: Link) -> float:
    """Seconds of a ring collective of ``nbytes`` over ``ranks`` (kind: ``all_reduce``,
    ``reduce_scatter`` or ``all_gather``)."""
    if kind not in ("all_reduce", "reduce_scatter", "all_gather"):
        raise ValueError(f"kind={kind!r}; expected all_reduce, reduce_scatter or all_gather")
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    one_way = (ranks - 1) * link.latency + (ranks - 1) / ranks * nbytes / link.bandwidth
    return 2 * one_way if kind == "all_reduce" else one_way


def train_flops_per_token(model: ModelSpec, seq_len: int, checkpointing: bool) -> float:
    """FLOPs per token of forward + backward (+ the recomputed forward)."""
    attention = 4 * model.layers * model.hidden * seq_len
    forward = 2 * model.params + attention
    return forward * (4 if checkpointing else 3)


@dataclass(frozen=True)
class Schedule:
    """How one optimizer step runs: the engine's knobs and the accumulation."""

    stage: int
    """ZeRO stage 0-3."""
    blocks_per_unit: int = 1
    """Transformer blocks per unit (one all-gather and one reduction each)."""
    prefetch: int = 1
    """Stage 3: units whose gathers are issued ahead (``ZeroConfig.prefetch``)."""
    micro_batches: int = 1
    """Forward/backward passes per optimizer step (gradient accumulation steps)."""
    tp: int = 1
    """Tensor-parallel degree; the data-parallel degree is gpus / tp."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3) or isinstance(self.stage, bool):
            raise ValueError(f"stage={self.stage!r} is not a ZeRO stage; expected 0-3")
        for name, least in (("blocks_per_unit", 1), ("prefetch", 0), ("micro_batches", 1),
                            ("tp", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{name}={v!r} must be an integer >= {least}")


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step and where they go."""

    strategy: str
    """DDP, ZeRO-1, ZeRO-2 or ZeRO-3."""
    step: float
    """Seconds per optimizer step."""
    compute: float
    """Seconds of forward and backward compute (recompute included), all micro-batches."""
    tp_comm: float
    """Seconds of TP's activation all-reduces (on the compute path, never hidden)."""
    optimizer: float
    """Seconds of the optimizer step on this GPU's shard."""
    comm: float
    """Seconds the data-parallel collectives occupy the link."""
    exposed: float
    """Seconds the compute stream waits for data-parallel communication."""
    tokens_per_gpu: float
    """Tokens per second per GPU (global tokens per step / step / GPUs)."""

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("strategy", "step", "compute", "tp_comm",
                                              "optimizer", "comm", "exposed",
                                              "tokens_per_gpu")}


class _Link:
    """One serial channel: collectives run one after another in issue order."""

    def __init__(self) -> None:
        self.free = 0.0

    def run(self, issued: float, seconds: float) -> float:
        self.free = max(issued, self.free) + seconds
        return self.free


def _pass(t: float, link: _Link, units: int, compute: float, gather: float | None,
          prefetch: int, reduce: float | None, flying: list[float],
          bounded: bool = True) -> float:
    """One forward (``reduce`` None) or backward pass over ``units`` units; returns the
    compute clock at its end. ``gather`` None: the weights are already whole;
    ``bounded``: at most two reductions in flight."""
    landed: dict[int, float] = {}
    for k in range(units):
        if gather is not None:
            if k not in landed:  # gathered on use
                landed[k] = link.run(t, gather)
            t = max(t, landed[k])
            for j in range(k + 1, min(units, k + 1 + prefetch)):
                if j not in landed:  # prefetched once this unit's gather has landed
                    landed[j] = link.run(t, gather)
        t += compute
        if reduce is not None:
            flying.append(link.run(t, reduce))
            if bounded and len(flying) > 2:  # a third in flight: the oldest lands first
                t = max(t, flying[-3])
    return t


def step_time(model: ModelSpec, recipe: Recipe, work: Workload, gpus: int, cluster: Cluster,
              schedule: Schedule) -> StepTime:
    """Predicted step time of ``schedule`` on ``gpus`` GPUs of ``cluster``, each running
    micro-batches of ``work.tokens`` tokens (sequences of ``work.seq_len``)."""
    if model.hidden is None or model.layers is None:
        raise ValueError("the step-time model needs the model's shape: give --hidden and "
                         "--layers (or a preset)")
    tp, stage = schedule.tp, schedule.stage
    dp = dp_degree(gpus, tp)
    acc = cluster.accelerator
    rate = acc.peak_flops * acc.efficiency
    units = -(-model.layers // schedule.blocks_per_unit)
    layers_per_unit = model.layers / units
    seq = work.seq_len or work.tokens
    fwd = train_flops_per_token(model, seq, False) / 3 * work.tokens / tp / rate
    # TP: 2 all-reduces per layer in forward, 2 in backward, 2 more for a recompute
    tp_ar = ring_time("all_reduce", work.tokens * model.hidden * recipe.activation_bytes, tp,
                      cluster.link(tp))
    f_unit = fwd / units + 2 * layers_per_unit * tp_ar
    recompute = 1 if work.checkpointing else 0
    b_unit = (2 + recompute) * fwd / units + (2 + 2 * recompute) * layers_per_unit * tp_ar

    link = cluster.link(gpus)
    unit_params = model.params / tp / units
    gather = ring_time("all_gather", unit_params * recipe.weight_bytes, dp, link)
    reduce = ring_time("all_reduce" if stage == 0 else "reduce_scatter",
                       unit_params * recipe.reduce_bytes, dp, link)
    g = gather if stage == 3 else None
    pf = schedule.prefetch

    line = _Link()
    t, flying, ends = 0.0, [], []
    for _ in range(min(schedule.micro_batches, SIMULATED)):
        t = _pass(t, line, units, f_unit, g, pf, None, [])
        t = max([t, *flying])  # a backward starts once the last one's reductions landed
        flying = []
        t = _pass(t, line, units, b_unit, g, pf, reduce, flying, bounded=stage > 0)
        ends.append(t)
    extra = schedule.micro_batches - len(ends)
    shift = extra * (ends[-1] - ends[-2]) if extra > 0 else 0.0
    t = max([t, *flying]) + shift  # the step waits for the last reduction

    owned = model.params / tp / (dp if stage >= 1 else 1)
    streamed = 2 * (recipe.optimizer_bytes + recipe.weight_bytes) + recipe.grad_bytes
    optimizer = owned * streamed / acc.memory_bandwidth
    t += optimizer
    post = units * ring_time("all_gather", unit_params * recipe.weight_bytes, dp, link) \
        if stage in (1, 2) else 0.0
    t += post

    a = schedule.micro_batches
    compute = a * (1 + 2 + recompute) * fwd
    tp_comm = a * model.layers * (4 + 2 * recompute) * tp_ar
    per_pass = units * (gather if stage == 3 else 0.0)
    comm = a * (2 * per_pass + units * reduce) + post
    if not cluster.network.overlap:
        t = compute + tp_comm + optimizer + comm
    return StepTime(STRATEGIES[stage], t, compute, tp_comm, optimizer, comm,
                    max(0.0, t - compute - tp_comm - optimizer),
                    work.tokens * a / tp / t)


def step_times(model: ModelSpec, recipe: Recipe, work: Workload, gpus: int, cluster: Cluster,
               blocks_per_unit: int = 1, prefetch: int = 1, micro_batches: int = 1,
               tp: int = 1) -> list[StepTime]:
    """One :class:`StepTime` per strategy, DDP first."""
    return [step_time(model, recipe, work, gpus, cluster,
                      Schedule(s, blocks_per_unit, prefetch, micro_batches, tp))
            for s in range(4)]
