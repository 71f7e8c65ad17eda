"""What a resume says. Every resume is one line on rank 0 naming the checkpoint and its
step; a restart (workers that torchrun, or ``zeroshard train --max-restarts``, started
again after a failure) is said as one too, with one record in the JSON log; and where the
world is not the checkpoint's, the line names the ranks lost, the new N and how the
global batch is made at it.

A rank knows it was restarted from ``TORCHELASTIC_RESTART_COUNT``, which torchrun's
agent sets. Each agent counts only its own restarts (a node whose workers are stopped
because another node's failed counts none: ``_invoke_run`` in
``torch/distributed/elastic/agent/server/api.py``), so the ranks take the largest.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

from .run import Run

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def restarted() -> bool:
    """Whether this rank's agent has restarted its workers (this process is one)."""
    return int(os.environ.get(RESTART_ENV) or 0) > 0


def node() -> str:
    """This rank's node: its host and its launcher's process id (torchrun's agent). An
    agent outlives its restarts, so a checkpoint's rank whose node is not among the
    current ranks' was lost with that node."""
    return f"{socket.gethostname()}:{os.getppid()}"


def gather(run: Run) -> int:
    """Every rank's restart count and node (``run.nodes``, which saves keep); returns
    the largest count."""
    every = [None] * run.world
    dist.all_gather_object(every, (int(os.environ.get(RESTART_ENV) or 0), node()))
    run.nodes = [n for _, n in every]
    return max(c for c, _ in every)


def process_start() -> float | None:
    """When this process started (Unix time; Linux's /proc), for the restart's record:
    the time from a failure to it is torchrun's detection and restart."""
    try:  # both since boot, on one clock (the boot time in /proc/stat is whole seconds)
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return round(time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK"), 2)


def _ranks(ranks: list[int]) -> str:
    """``[2, 3, 5]`` as "ranks 2-3, 5"."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def announce(run: Run, ckpt: Path | None, extra: dict, restarts: int, load_s: float) -> None:
    """Say where the run starts (nothing for a first start), and the checkpoint's ranks
    whose node is gone when some node of it lives on (a restart keeps the agents that
    survive); for a restart write the JSON log's record: ``{"event": "restart",
    "restart": k, "resumed_from": step, "checkpoint", "world", "saved_world",
    "lost_ranks", "load_s", "process_start", "time"}``."""
    cfg, world = run.cfg, run.world
    if ckpt is None and not restarts:
        return
    start = extra.get("step", 0)
    saved_world = extra.get("world", world)
    saved_nodes = extra.get("nodes", [])
    lost = [r for r, n in enumerate(saved_nodes) if n not in set(run.nodes)]
    if not restarts or len(lost) == len(saved_nodes):
        lost = []  # nodes of another launch: its agents are gone, not its ranks lost
    head = f"restart {restarts}: " if restarts else ""
    if lost:
        head += f"{_ranks(lost)} of {saved_world} lost; "
    if ckpt is None:
        text = f"no checkpoint in {cfg.save_dir} yet: training again from step 0 at N = {world}"
    elif start >= cfg.steps:
        text = f"{ckpt} is at step {start} of {cfg.steps}: nothing to train"
    else:
        text = f"resumed from {ckpt} (step {start}): weights, optimizer state, schedule"
        if world != saved_world:
            text += (f"; now at N = {world}, saved at N = {saved_world}: global batch "
                     f"{cfg.batch} = {world} x {run.micro} x {run.accum} micro-batch(es)")
        elif restarts:
            text += f", at N = {world}"
    run.out.line(head + text)
    if restarts and run.log:
        run.log.write(json.dumps({
            "event": "restart", "restart": restarts, "resumed_from": start,
            "checkpoint": None if ckpt is None else str(ckpt), "world": world,
            "saved_world": saved_world, "lost_ranks": lost, "load_s": round(load_s, 3),
            "process_start": process_start(), "time": time.time()}) + "\n")
        run.log.flush()
