"""Advice: which strategy fits, the fewest GPUs that fit, and the floors that stop it.

Replicated categories set a floor that no number of GPUs removes: as N grows,
ZeRO-1 tends to (weights + grads)·P (4P for 2/2/12), ZeRO-2 to weights·P (2P),
DDP never shrinks, and only ZeRO-3 keeps falling (to the activations alone).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..spec.config import ZeroConfig
from ..spec.dims import ParallelDims
from ..spec.rules import OFFLOADS
from .arch import ModelSpec
from .hardware import DEFAULT_HOST, HOSTS, Host
from .layout import stages_taking
from .memory import STRATEGIES, Workload, plan_strategy
from .placement import host_step_bytes, owned, pcie_bytes

#: Largest GPU count :func:`min_gpus` searches, and the most ``zeroshard plan`` plans.
MAX_GPUS = 1 << 20

#: Most parameters ``zeroshard plan`` plans: 10^15, some 500 times the largest published
#: models, and below where its byte counts (16 per parameter) leave float64's exact range.
MAX_PARAMS = 10**15


def floor_bytes(model: ModelSpec, config: ZeroConfig) -> int:
    """Per-GPU model-state bytes that stay however many GPUs share the work: the
    categories ``config``'s stage replicates (4P for ZeRO-1 under 2/2/12). Activations
    come on top."""
    policy, recipe = config.policy, config.recipe
    per_param = (
        (0 if policy.shards_params else recipe.weight_bytes)
        + (0 if policy.shards_grads else recipe.grad_bytes)
        + (0 if policy.shards_optimizer else recipe.optimizer_bytes)
    )
    return per_param * model.params


def gpu_counts(step: int | None, limit: int = MAX_GPUS) -> list[int]:
    """Candidate GPU counts: powers of two (``step`` None, as a cluster is usually
    carved), else 1 and the multiples of ``step`` (``step=8``: whole 8-GPU nodes)."""
    if step is None:
        return [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]
    if step <= 0:
        raise ValueError(f"gpu step {step} must be positive")
    return sorted({1, *range(step, limit + 1, step)})


@dataclass(frozen=True)
class MinGpus:
    """The fewest GPUs at which a strategy fits, or why none does."""

    strategy: str
    gpus: int | None
    """None: it never fits (its floor is at or above the budget)."""
    total: int | None
    """Per-GPU bytes at ``gpus``."""
    floor: int
    """Per-GPU model-state bytes as N grows without bound (activations excluded)."""

    def as_dict(self) -> dict:
        return {"strategy": self.strategy, "gpus": self.gpus, "total": self.total,
                "floor": self.floor}


def min_gpus(model: ModelSpec, config: ZeroConfig, budget: int,
             work: Workload | None = None, step: int | None = None) -> MinGpus:
    """The smallest candidate N (see :func:`gpu_counts`) at which ``config`` (sharded
    over all N) fits ``budget`` per GPU. Per-GPU memory never grows with N, so a binary
    search finds it."""
    name = STRATEGIES[config.stage]
    floor = floor_bytes(model, config)
    counts = gpu_counts(step)

    def total(i: int) -> int:
        return plan_strategy(model, ParallelDims(counts[i]), config, work, budget).total

    if total(len(counts) - 1) > budget:
        return MinGpus(name, None, None, floor)
    lo, hi = 0, len(counts) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if total(mid) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return MinGpus(name, counts[lo], total(lo), floor)


def first_fit(plans) -> str | None:
    """The first strategy in DDP → ZeRO-3 order that fits, or None."""
    for p in plans:
        if p.fits:
            return p.strategy
    return None


def min_shard_group(model: ModelSpec, config: ZeroConfig, gpus: int, budget: int,
                    work: Workload | None = None) -> int | None:
    """The smallest shard group (a divisor of ``gpus``) in which ZeRO-3 (``config`` at
    stage 3) fits ``budget`` under hybrid sharding, or None; per-GPU memory falls as
    the group grows."""
    zero3 = replace(config.at_stage(3), shard_group=None)
    for k in (d for d in range(1, gpus + 1) if gpus % d == 0):
        if plan_strategy(model, ParallelDims(gpus, shard=k), zero3, work, budget).fits:
            return k
    return None


def why_none_fits(model: ModelSpec, dims: ParallelDims, config: ZeroConfig, budget: int,
                  work: Workload | None = None) -> str:
    """One sentence on why no strategy of ``config`` fits on the layout ``dims`` (in
    shard groups: more GPUs do not help there, a larger group does)."""
    gpus, shard_group = dims.world, dims.shard
    if shard_group is not None and shard_group < gpus:
        k = min_shard_group(model, config, gpus, budget, work)
        if k is not None:
            return (f"nothing fits in shard groups of {shard_group} on {gpus} GPUs; ZeRO-3 "
                    f"fits in groups of {k}")
        plain = replace(config, shard_group=None)
        return (f"nothing fits in shard groups of {shard_group} on {gpus} GPUs, nor does "
                "ZeRO-3 over all of them; " + why_none_fits(model, ParallelDims(gpus), plain,
                                                             budget, work))
    zero3 = replace(config.at_stage(3), shard_group=None)
    need = min_gpus(model, zero3, budget, work)
    if need.gpus is None:
        most = plan_strategy(model, ParallelDims(MAX_GPUS), zero3, work, budget)
        if most.activations is not None and most.activations > budget:
            return (
                "nothing fits: even ZeRO-3 tends to its activations alone, which are above "
                f"the budget of {budget:,} bytes; shorten the micro-batch or checkpoint "
                "activations"
            )
        return (f"nothing fits: even ZeRO-3 on {MAX_GPUS:,} GPUs, the most the planner "
                f"searches, needs {most.total:,} bytes per GPU, above the budget of "
                f"{budget:,}")
    return f"nothing fits on {gpus} GPUs; ZeRO-3 fits from {need.gpus} GPUs"


def offload_offer(model: ModelSpec, dims: ParallelDims, config: ZeroConfig, budget: int,
                  work: Workload | None = None, gpus_per_node: int = 8,
                  host: Host | None = None, unit: int = 10**9,
                  unit_name: str = "GB") -> str | None:
    """When no strategy fits the device: the first that fits with offload (``config``'s
    precision with the optimizer in host memory at each stage that takes it, then the
    weight shards too), its device and host bytes, and what a step of one micro-batch
    pays for it: the PCIe copies (gradients down in the master dtype, weights up) and
    the host step, at ``host``'s rates (``plan/placement.py``). None when nothing fits
    even so."""
    host = host or HOSTS[DEFAULT_HOST]
    for offload in OFFLOADS:
        asked = replace(config, stage=3, offload=offload, offload_dir=None)
        for staged in stages_taking(asked):
            p = plan_strategy(model, dims, staged, work, budget)
            if not p.fits:
                continue
            moved = pcie_bytes(model.params, dims, staged)
            pcie = (moved["down"] + moved["up"]) / host.pcie.bandwidth
            n = owned(model.params, dims, staged.policy)
            step = n * host_step_bytes(staged.recipe) / (host.memory_bandwidth / gpus_per_node)
            gb = lambda b: f"{b / unit:.2f} {unit_name}"  # noqa: E731
            return (f"with offload='{offload}' {p.strategy} fits: {gb(p.total)} on the GPU, "
                    f"{gb(p.host)} of host memory per GPU ({gb(p.host * gpus_per_node)} for a "
                    f"node of {gpus_per_node}); each step of one micro-batch adds {pcie:.3f} s "
                    f"over {host.pcie.name} ({gb(moved['down'])} of gradients down, "
                    f"{gb(moved['up'])} of weights up) and a {step:.3f} s host step "
                    f"(--offload {offload})")
    return None
