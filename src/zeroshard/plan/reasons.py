"""The reasons ``zeroshard plan --recommend`` gives: one sentence per choice, each with
what the alternatives would cost (``recommend.py`` finds the candidates)."""

from __future__ import annotations

from ..spec.dims import ParallelDims
from ..spec.policy import ShardPolicy
from .advice import gpu_counts
from .memory import STRATEGIES, Workload
from .peak import peak
from .placement import disk_io_bytes, pcie_bytes

#: A more complex configuration must beat a simpler one by more than this fraction.
TIE = 0.01
BLOCKS_PER_UNIT = (1, 2, 4)
PREFETCH = (0, 1, 2)


def gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB"


def pct(c, best) -> str:
    """How much slower ``c`` is than ``best``, as a signed percentage."""
    return f"{(c.time.step / best.time.step - 1) * 100:+.1f}%"


def best_where(found, **fixed):
    """The fastest candidate with the given field values, or None."""
    pool = [c for c in found if all(getattr(c, k) == v for k, v in fixed.items())]
    return min(pool, key=lambda c: (c.time.step, c.key)) if pool else None


def shard_reason(b, found, need: dict, groups: dict, cluster) -> str:
    """Hybrid sharding weighed against plain sharding over every data-parallel rank, at
    the chosen stage and TP degree: memory (the floor rises to the stage's state over
    K), where the traffic goes (the group's on the link of its K·tp GPUs, the replicas'
    all-reduce of 1/K of the gradients across groups, on the compute path), and the
    predicted step."""
    dp = b.dp
    if b.shard_group is None:
        head = (f"all {dp} data-parallel ranks (plain {b.strategy}): its collectives span "
                f"{cluster.link(dp * b.tp).name}")
    else:
        k, r = b.shard_group, dp // b.shard_group
        across = cluster.link(r, stride=k * b.tp).name
        head = (f"{k} ({b.strategy} inside groups of {k * b.tp} GPUs on "
                f"{cluster.link(k * b.tp).name}, replicated {r} times: 1/{k} of the gradients "
                f"all-reduced across groups on {across}, {b.time.across:.3f} s per step on "
                f"the compute path)")
    alts = []
    for k in [None, *groups.get(b.tp, ())]:
        if k == b.shard_group:
            continue
        a = best_where(found, stage=b.stage, tp=b.tp, shard_group=k)
        name = "plain" if k is None else f"groups of {k}"
        if a is not None:
            extra = f", {a.time.across:.3f} s across" if k is not None else ""
            alts.append(f"{name} {pct(a, b)} ({gb(a.memory)} per GPU{extra})")
        elif (b.stage, b.tp, k) in need:
            alts.append(f"{name} does not fit (needs {gb(need[b.stage, b.tp, k])} or more)")
    if not alts:
        return head + "; the only layout tried"
    return head + "; " + ", ".join(alts)


def reasons(best, found, need: dict, tps, groups: dict, cluster, limit: int,
            global_batch: int, seq_len: int, headroom: float) -> dict:
    """One sentence per choice: stage, tp, shard group, unit size, prefetch,
    checkpointing, micro-batch."""
    b = best
    others = []
    for s, name in enumerate(STRATEGIES):
        if name == b.strategy:
            continue
        alt = best_where(found, stage=s)
        least = min((v for key, v in need.items() if STRATEGIES[key[0]] == name), default=0)
        others.append(f"{name} " + (f"{pct(alt, b)} at best" if alt else
                                    f"does not fit (needs {gb(least)} or more)"))
    why = {"stage": (f"{b.strategy}: the lowest stage within {TIE:.0%} of the fastest that "
                     f"fits {gb(limit)} ({headroom:.0%} headroom); " + "; ".join(others))}
    same = dict(stage=b.stage, group_gpus=b.group_gpus)  # the same layout: plain or groups
    alts = [f"TP {k} " + (f"{pct(a, b)}" if (a := best_where(found, tp=k, **same))
                          else "does not fit") for k in tps if k != b.tp]
    why["tp"] = (f"{b.tp}: " + ("no tensor parallelism; " if b.tp == 1 else
                                f"{b.tp}-way inside a node, its all-reduces never hidden "
                                f"({b.time.tp_comm:.3f} s per step); ")
                 + (", ".join(alts) if alts else "the only degree tried"))
    why["shard group"] = shard_reason(b, found, need, groups, cluster)
    same = dict(stage=b.stage, tp=b.tp, shard_group=b.shard_group)
    alts = [f"{k} {pct(a, b)}" for k in BLOCKS_PER_UNIT if k != b.blocks_per_unit
            and (a := best_where(found, prefetch=b.prefetch, checkpointing=b.checkpointing,
                                 blocks_per_unit=k, **same))]
    why["unit size"] = (f"{b.blocks_per_unit} block(s) per unit: one gather and one "
                        "reduction per unit; finer units pay the latency α more often, "
                        "coarser ones hold more transient memory and expose a bigger first "
                        "gather" + (f"; {', '.join(alts)}" if alts else ""))
    if b.policy.shards_params:
        alts = [f"{d} {pct(a, b)}" for d in PREFETCH if d != b.prefetch
                and (a := best_where(found, checkpointing=b.checkpointing,
                                     blocks_per_unit=b.blocks_per_unit, prefetch=d, **same))]
        why["prefetch"] = (f"{b.prefetch}: gathers exposed {b.time.exposed:.3f} s per step; "
                           "each unit of depth holds one more gathered unit"
                           + (f"; {', '.join(alts)}" if alts else ""))
    else:
        why["prefetch"] = "n/a: below stage 3 the weights are whole, nothing is gathered"
    why["checkpointing"] = checkpointing_reason(b, found, same)
    why["micro-batch"] = (f"{b.micro_batch} sequence(s) of {seq_len} tokens per GPU, "
                          f"{b.accumulation} accumulation step(s): the largest that fits "
                          f"({gb(b.memory)} per GPU) for {global_batch} sequences over "
                          f"{global_batch // (b.micro_batch * b.accumulation)} data-parallel "
                          "ranks; fewer passes mean fewer reductions (the engine reduces "
                          "after every backward)")
    return why


#: What each mode recomputes in backward, for the reason's first words.
_RECOMPUTES = {
    "none": "none: every activation kept, nothing recomputed",
    "selective": "selective: the linear layers' outputs kept, attention's core and the "
                 "elementwise operations recomputed (a few percent more compute)",
    "full": "full: each block keeps its input and recomputes its forward (a third more "
            "compute)",
}


def checkpointing_reason(b, found, same: dict) -> str:
    """Why this checkpointing: the least recompute whose micro-batch wins, and the best of
    each other mode on the same layout."""
    alts = []
    for mode in _RECOMPUTES:
        if mode == b.checkpointing:
            continue
        a = best_where(found, checkpointing=mode, **same)
        alts.append(f"{mode} {pct(a, b)} (micro-batch {a.micro_batch})" if a else
                    f"{mode} does not fit even one sequence")
    return _RECOMPUTES[b.checkpointing] + "; " + ", ".join(alts)


def _group_name(shard_group: int | str, cluster) -> str:
    if shard_group == "node":
        return f"a node ({cluster.gpus_per_node} GPUs)"
    return f"{shard_group} ranks"


def _fewest_gpus(model, config, limit: int, work: Workload) -> int | None:
    """The fewest whole 8-GPU nodes (or 1) at which ZeRO-3's planned peak with
    ``work`` fits ``limit`` (``config``'s precision, plain sharding); the peak never
    grows with N, so a binary search."""
    counts = gpu_counts(8)
    zero3 = config.at_stage(3)
    fits = lambda i: peak(model, ParallelDims(counts[i]), zero3,  # noqa: E731
                          work).bytes <= limit
    if not fits(len(counts) - 1):
        return None
    lo, hi = 0, len(counts) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return counts[lo]


def _zero3_need(need: dict, grouped: bool = False) -> int:
    """The least ZeRO-3 (the stage that shards the weights too) needs in ``need`` (keys
    (stage, tp, shard group)), in shard groups only with ``grouped``."""
    return min((v for (s, _, g), v in need.items()
                if ShardPolicy.for_stage(s).shards_params and (g or not grouped)), default=0)


def none_reason(model, config, gpus: int, cluster, limit: int, headroom: float, need: dict,
                groups: dict, seq_len: int, flash: bool, offload_need: dict) -> str:
    """Why nothing fits: what even ZeRO-3 with one sequence needs (on the device, and
    with offload when it was tried), and what would make it fit."""
    shard_group = config.shard_group
    still = ""
    if offload_need:
        least = _zero3_need(offload_need)
        still = (f"; with the optimizer and the weight shards in host memory it still needs "
                 f"{gb(least)}")
    if any(groups.values()) and shard_group is not None:
        least = _zero3_need(need, grouped=True)
        return (f"nothing fits {gb(limit)} per GPU ({headroom:.0%} headroom) in shard "
                f"groups of {_group_name(shard_group, cluster)}: even ZeRO-3 with "
                f"checkpointing and one sequence needs {gb(least)}{still}, and more GPUs do "
                "not lower it; a larger group does (or no group: plain sharding over every "
                "rank)")
    least = _zero3_need(need)
    fewest = _fewest_gpus(model, config, limit, Workload(seq_len, seq_len, True, flash))
    return (f"nothing fits {gb(limit)} per GPU ({headroom:.0%} headroom) on {gpus} "
            f"GPUs: even ZeRO-3 with checkpointing and one sequence needs "
            f"{gb(least)}{still}; " + (
                f"its peak fits from {fewest} GPUs"
                if fewest else "no GPU count fits; shorten the sequences")
            + (" (--headroom sets the share left free)" if headroom else ""))


def offload_reason(b, device_need: dict, limit: int, model, gpus: int, cluster,
                   asked: str | None) -> str:
    """What offload costs (or that none is needed): host memory per GPU and per node, the
    bytes over PCIe per step and their seconds on the compute path, the host step; on
    disk, the bytes in files and the seconds the drive adds to the host step."""
    if b.offload is None:
        return "none: the state fits on the device"
    least = min(device_need.values(), default=0)
    why = ("asked for (--offload)" if asked else
           f"nothing fits {gb(limit)} on the device without it (the least any stage needs "
           f"is {gb(least)})")
    where = ("the master, the optimizer state and the weight shards" if b.offload == "params"
             else "the master and the optimizer state")
    config, dims = b.config, b.dims
    placed = peak(model, dims, config, Workload(), b.blocks_per_unit)
    moved = pcie_bytes(model.params, dims, config, b.accumulation)
    t, node = b.time, cluster.gpus_per_node
    cost = t.pcie + t.optimizer + t.disk_wait
    if b.offload_dir:
        files = disk_io_bytes(model.params, dims, config)["read"]
        where = (f"{where} live in files (--offload-dir), {gb(files)} per GPU read and "
                 f"written each step: {t.disk:.3f} s of disk I/O at "
                 f"{cluster.host_side.disk_bandwidth / 1e9:g} GB/s, {t.disk_wait:.3f} s "
                 f"of it beyond the host step; host memory holds the fp32 gradients and "
                 f"the step's sub-groups of {config.sub_group_size:,} elements")
        held = "at the step"
    else:
        where = f"{where} live in host memory"
        held = "at the step with AdamW's temporaries"
    return (f"{b.offload}: {why}; {where}, {gb(placed.host)} per GPU {held} "
            f"({gb(placed.host * node)} per node of {node}); per step {gb(moved['down'])} "
            f"of gradients go down and {gb(moved['up'])} of weights up over "
            f"{cluster.host_side.pcie.name}, {t.pcie:.3f} s on the compute path, and the "
            f"host step takes {t.optimizer:.3f} s: {cost:.3f} s of the {t.step:.3f} s step "
            f"({cost / t.step:.0%})")
