"""The ``zeroshard plan`` flags of the group "time and recommendation".

``--time`` adds the step-time table (``plan/steptime.py``) to the plan; ``--recommend``
replaces the plan with the recommended configuration (``plan/recommend.py``). ``--tp``
applies to the memory plan as well, and so does ``--shard-group`` (hybrid sharding:
:func:`shard_group`).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

from ..plan.failures import RESTART_S, checkpoint_bytes, plan_restarts
from ..plan.hardware import (
    ACCELERATORS,
    DEFAULT_ACCELERATOR,
    DEFAULT_HOST,
    DEFAULT_NETWORK,
    HOSTS,
    NETWORKS,
    Cluster,
    get_accelerator,
    get_host,
    get_network,
)
from ..plan.recommend import HEADROOM, recommend
from ..plan.steptime import Schedule, step_times
from ..plan.workload import Workload
from ..spec.config import PLANNED_DISK

#: Global batch of --recommend when none is given: 1,024 sequences (2M tokens at 2,048).
DEFAULT_GLOBAL_BATCH = 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("time and recommendation")
    t.add_argument("--time", action="store_true",
                   help="predicted step time per strategy: compute, communication, exposed "
                        "communication, tokens/s per GPU")
    t.add_argument("--recommend", action="store_true",
                   help="the stage, tensor parallelism, unit size, prefetch, checkpointing and "
                        "micro-batch to run, with a reason for each and the runners-up")
    t.add_argument("--accelerator", default=DEFAULT_ACCELERATOR,
                   help=f"one of {', '.join(ACCELERATORS)} (default {DEFAULT_ACCELERATOR})")
    t.add_argument("--efficiency", type=float,
                   help="fraction of the accelerator's peak FLOP/s reached (default: the "
                        "preset's, calibrated on published runs: a100 0.59, h100 0.44)")
    t.add_argument("--network", default=DEFAULT_NETWORK,
                   help=f"intra-/inter-node links: one of {', '.join(NETWORKS)} "
                        f"(default {DEFAULT_NETWORK})")
    t.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs sharing the intra-node link and a node's host memory (default 8)")
    t.add_argument("--host", default=DEFAULT_HOST,
                   help=f"with --offload: each GPU's PCIe link to host memory and the node's "
                        f"host memory bandwidth, one of {', '.join(HOSTS)} (default "
                        f"{DEFAULT_HOST}: PCIe 5.0 x16 at 55 GB/s, 460 GB/s of DDR5)")
    t.add_argument("--host-bandwidth", type=float, metavar="GB/S",
                   help="with --offload: the node's host memory bandwidth in GB/s, shared by "
                        "its GPUs' optimizer steps (default: the --host preset's)")
    t.add_argument("--disk-bandwidth", type=float, metavar="GB/S",
                   help="with --offload-dir: GB/s each GPU's drive reads, or writes, one way "
                        "at a time (default: the --host preset's, 5: a PCIe 4.0 NVMe drive)")
    t.add_argument("--global-batch", type=int, metavar="SEQUENCES",
                   help="sequences per optimizer step over all GPUs, each of --seq-len tokens "
                        "(default --tokens); with --time it sets the accumulation steps, "
                        f"with --recommend the default is {DEFAULT_GLOBAL_BATCH}")
    t.add_argument("--tp", type=int,
                   help="tensor-parallel degree K: ZeRO runs over --gpus / K data-parallel "
                        "ranks (default 1; --recommend tries 1, 2, 4, 8 unless given)")
    t.add_argument("--prefetch", type=int,
                   help="stage-3 units gathered ahead (default 1; --recommend tries 0-2 "
                        "unless given)")
    t.add_argument("--headroom", type=float, default=HEADROOM, metavar="FRACTION",
                   help=f"with --recommend: the share of GPU memory left free "
                        f"(default {HEADROOM})")
    t.add_argument("--blocks-per-unit", type=int, default=1,
                   help="with --time: transformer blocks per unit (default 1)")
    t.add_argument("--save-every", type=int, metavar="STEPS",
                   help="with --time or --recommend: what a failure costs a run that saves "
                        "a checkpoint every STEPS steps (detect, restart, load, the steps "
                        "since the last save) and what saving costs (plan/failures.py)")
    t.add_argument("--mtbf-hours", type=float, metavar="H",
                   help="with --time or --recommend: the job's mean time between failures; "
                        "adds the share of the run lost and the save interval that loses "
                        "least (Young 1974, Daly 2006)")
    t.add_argument("--restart-seconds", type=float, metavar="S",
                   help=f"with --save-every or --mtbf-hours: seconds from the end of a "
                        f"failed attempt to the ranks built again (default {RESTART_S:g})")


def check(args) -> None:
    """Flag values that are wrong whatever else is asked."""
    for name in ("gpus_per_node", "global_batch", "tp", "blocks_per_unit"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise ValueError(f"--{name.replace('_', '-')}={v} must be positive")
    if args.prefetch is not None and args.prefetch < 0:
        raise ValueError(f"--prefetch={args.prefetch} must be 0 or more")
    if not 0 <= args.headroom < 1:
        raise ValueError(f"--headroom={args.headroom} must be a fraction in [0, 1)")
    for name in ("host_bandwidth", "disk_bandwidth"):
        v = getattr(args, name)
        if v is not None and not 0 < v < math.inf:
            raise ValueError(f"--{name.replace('_', '-')}={v} must be a positive, finite "
                             "number of GB/s")
    if args.disk_bandwidth is not None and not args.offload_dir:
        raise ValueError(f"--disk-bandwidth={args.disk_bandwidth} prices disk offload: add "
                         "--offload-dir")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise ValueError(f"--efficiency={args.efficiency} must be in (0, 1]")
    if args.time and args.recommend:
        raise ValueError("--time and --recommend contradict each other; give one")
    for name in ("save_every", "mtbf_hours", "restart_seconds"):
        v = getattr(args, name)
        if v is not None and (v <= 0 or not (args.time or args.recommend)):
            raise ValueError(f"--{name.replace('_', '-')}={v} must be positive" if v <= 0 else
                             f"--{name.replace('_', '-')} prices restarts in the step time: "
                             "add --time or --recommend")
    if args.restart_seconds is not None and not (args.save_every or args.mtbf_hours):
        raise ValueError("--restart-seconds needs --save-every or --mtbf-hours")
    if args.tp is not None:
        dp(args, args.tp)
    cluster(args)  # names an unknown preset even when no time is asked for
    shard_group(args, per_tp=True)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def dp(args, tp: int) -> int:
    """Data-parallel ranks: ``--gpus / --tp``, which must divide."""
    if args.gpus % tp:
        raise ValueError(f"--tp={tp} does not divide --gpus={args.gpus}; expected one of "
                         f"{_divisors(args.gpus)}")
    return args.gpus // tp


def shard_group(args, per_tp: bool = False) -> int | str | None:
    """``--shard-group``: None (plain), an integer K of data-parallel ranks dividing
    them, or ``node``: a node's data-parallel ranks, ``--gpus-per-node / --tp``
    (with ``per_tp``, left as ``"node"`` for ``--recommend`` to take at each TP degree)."""
    spec = getattr(args, "shard_group", None)
    if spec is None:
        return None
    tp = args.tp or 1
    if str(spec).strip().lower() == "node":
        if per_tp and args.tp is None:
            return "node"
        if args.gpus_per_node % tp:
            raise ValueError(f"--shard-group=node: --gpus-per-node={args.gpus_per_node} is "
                             f"not divisible by --tp={tp}")
        k = args.gpus_per_node // tp
    else:
        try:
            k = int(spec)
        except ValueError:
            raise ValueError(f"--shard-group={spec!r} must be a positive integer or "
                             "'node'") from None
        if k <= 0:
            raise ValueError(f"--shard-group={spec} must be a positive integer or 'node'")
    if per_tp and args.tp is None:
        return k  # recommend tries it at each TP degree it divides
    ranks = dp(args, tp)
    if ranks % k:
        raise ValueError(f"--shard-group={spec} does not divide the {ranks} data-parallel "
                         f"ranks; expected one of {_divisors(ranks)}")
    return k


def cluster(args) -> Cluster:
    gb = lambda v: None if v is None else v * 1e9  # noqa: E731
    return Cluster(get_accelerator(args.accelerator, args.efficiency),
                   get_network(args.network), args.gpus_per_node,
                   get_host(args.host, gb(args.host_bandwidth), gb(args.disk_bandwidth)))


def accumulation(args, work: Workload, tp: int) -> int:
    """Micro-batches per step for --global-batch sequences (1 without it)."""
    if args.global_batch is None:
        return 1
    seq = work.seq_len or work.tokens
    ranks = dp(args, tp)
    total = args.global_batch * seq
    if total % (ranks * work.tokens):
        raise ValueError(f"--global-batch={args.global_batch} sequences of {seq} tokens do not "
                         f"divide into micro-batches of --tokens={work.tokens} over {ranks} "
                         "data-parallel ranks")
    return total // (ranks * work.tokens)


def run_time(args, model, dims, config, work) -> list:
    """One StepTime per strategy of ``config`` on ``dims`` for the plan's workload."""
    schedule = Schedule(args.blocks_per_unit, accumulation(args, work, dims.tp))
    return step_times(model, dims, config, work, cluster(args), schedule)


def restarts(args, model, config, st, writers: int):
    """``plan/failures.py``'s cost and sentence for steps of ``st`` (a StepTime), the
    checkpoint of ``config``'s recipe written by ``writers`` ranks at the host's disk
    bandwidth each."""
    return plan_restarts(st.step, checkpoint_bytes(model.params, config.recipe), writers,
                         cluster(args).host.disk_bandwidth, args.save_every,
                         None if args.mtbf_hours is None else args.mtbf_hours * 3600,
                         args.restart_seconds or RESTART_S, what=f" ({st.strategy})")


def run_recommend(args, model, config, budget, checkpointing: str | None = None):
    """``--recommend``: ``config`` gives the precision, a fixed ``--shard-group`` and an
    asked ``--offload``; ``--offload-dir`` without one places a fallback offload on
    disk; ``--save-every`` / ``--mtbf-hours`` add what restarts cost the pick;
    ``checkpointing``: the mode the flags fix (``plan_checks.asked_checkpointing``)."""
    seq = args.seq_len or args.tokens
    fallback_dir = PLANNED_DISK if args.offload_dir and not args.offload else None
    rec = recommend(model, config, args.gpus, budget, cluster(args),
                    args.global_batch or DEFAULT_GLOBAL_BATCH, seq, args.flash_attention,
                    args.tp, args.prefetch, headroom=args.headroom, offload_dir=fallback_dir,
                    checkpointing=checkpointing)
    if rec.best is not None and (args.save_every or args.mtbf_hours):
        _, text = restarts(args, model, config, rec.best.time,
                           rec.best.shard_group or rec.best.dp)
        rec = replace(rec, notes=(*rec.notes, text))
    return rec
