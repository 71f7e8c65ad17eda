"""Advice: which strategy fits, the fewest GPUs that fit, and the floors that stop it.

Replicated categories set a floor that no number of GPUs removes: as N grows,
ZeRO-1 tends to (weights + grads)·P (4P for 2/2/12), ZeRO-2 to weights·P (2P),
DDP never shrinks, and only ZeRO-3 keeps falling (to the activations alone).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.recipes import Recipe
from .arch import ModelSpec
from .hardware import DEFAULT_HOST, HOSTS, Host
from .memory import STRATEGIES, Workload, plan_strategy, stage_of
from .offload import host_step_bytes, owned, pcie_bytes

#: Largest GPU count :func:`min_gpus` searches.
MAX_GPUS = 1 << 20


def floor_bytes(model: ModelSpec, recipe: Recipe, strategy) -> int:
    """Per-GPU model-state bytes that stay however many GPUs share the work: the
    replicated categories (4P for ZeRO-1 under 2/2/12). Activations come on top."""
    stage = stage_of(strategy)
    per_param = (
        (recipe.weight_bytes if stage < 3 else 0)
        + (recipe.grad_bytes if stage < 2 else 0)
        + (recipe.optimizer_bytes if stage < 1 else 0)
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


def min_gpus(model: ModelSpec, recipe: Recipe, strategy, budget: int,
             work: Workload | None = None, step: int | None = None) -> MinGpus:
    """The smallest candidate N (see :func:`gpu_counts`) whose per-GPU total fits
    ``budget``. Per-GPU memory never grows with N, so a binary search finds it."""
    name = STRATEGIES[stage_of(strategy)]
    floor = floor_bytes(model, recipe, strategy)
    counts = gpu_counts(step)

    def total(i: int) -> int:
        return plan_strategy(model, counts[i], recipe, strategy, work, budget).total

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


def min_shard_group(model: ModelSpec, recipe: Recipe, gpus: int, budget: int,
                    work: Workload | None = None) -> int | None:
    """The smallest shard group (a divisor of ``gpus``) in which ZeRO-3 fits ``budget``
    under hybrid sharding, or None; per-GPU memory falls as the group grows."""
    for k in (d for d in range(1, gpus + 1) if gpus % d == 0):
        if plan_strategy(model, gpus, recipe, 3, work, budget, shard_group=k).fits:
            return k
    return None


def why_none_fits(model: ModelSpec, recipe: Recipe, gpus: int, budget: int,
                  work: Workload | None = None, shard_group: int | None = None) -> str:
    """One sentence on why no strategy fits at ``gpus`` GPUs (in shard groups of
    ``shard_group``: more GPUs do not help there, a larger group does)."""
    if shard_group is not None and shard_group < gpus:
        k = min_shard_group(model, recipe, gpus, budget, work)
        if k is not None:
            return (f"nothing fits in shard groups of {shard_group} on {gpus} GPUs; ZeRO-3 "
                    f"fits in groups of {k}")
        return (f"nothing fits in shard groups of {shard_group} on {gpus} GPUs, nor does "
                "ZeRO-3 over all of them; " + why_none_fits(model, recipe, gpus, budget, work))
    need = min_gpus(model, recipe, "ZeRO-3", budget, work)
    if need.gpus is None:
        return (
            "nothing fits: even ZeRO-3 tends to its activations alone, which are above the "
            f"budget of {budget:,} bytes; shorten the micro-batch or checkpoint activations"
        )
    return f"nothing fits on {gpus} GPUs; ZeRO-3 fits from {need.gpus} GPUs"


def offload_offer(model: ModelSpec, recipe: Recipe, gpus: int, budget: int,
                  work: Workload | None = None, shard_group: int | None = None,
                  gpus_per_node: int = 8, host: Host | None = None, unit: int = 10**9,
                  unit_name: str = "GB") -> str | None:
    """When no strategy fits the device: the first that fits with offload (the optimizer
    in host memory at stages 1, 2, 3, then the weight shards too at stage 3), its device
    and host bytes, and what a step of one micro-batch pays for it: the PCIe copies
    (gradients down in the master dtype, weights up) and the host step, at ``host``'s
    rates (``plan/offload.py``). None when nothing fits even so."""
    host = host or HOSTS[DEFAULT_HOST]
    for offload, stages in (("optimizer", (1, 2, 3)), ("params", (3,))):
        for stage in stages:
            p = plan_strategy(model, gpus, recipe, stage, work, budget, 1, shard_group,
                              offload)
            if not p.fits:
                continue
            moved = pcie_bytes(model.params, gpus, recipe, stage, offload, 1, shard_group)
            pcie = (moved["down"] + moved["up"]) / host.pcie.bandwidth
            n = owned(model.params, gpus, stage, 1, shard_group)
            step = n * host_step_bytes(recipe, offload) / (host.memory_bandwidth
                                                           / gpus_per_node)
            gb = lambda b: f"{b / unit:.2f} {unit_name}"  # noqa: E731
            return (f"with offload='{offload}' {p.strategy} fits: {gb(p.total)} on the GPU, "
                    f"{gb(p.host)} of host memory per GPU ({gb(p.host * gpus_per_node)} for a "
                    f"node of {gpus_per_node}); each step of one micro-batch adds {pcie:.3f} s "
                    f"over {host.pcie.name} ({gb(moved['down'])} of gradients down, "
                    f"{gb(moved['up'])} of weights up) and a {step:.3f} s host step "
                    f"(--offload {offload})")
    return None
