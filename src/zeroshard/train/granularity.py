"""The unit-granularity benchmark (``zeroshard bench granularity`` runs it): the same
model, N, global batch and reshard policy, grouped into units several ways, measured
on every rank with the engine's profiler.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..api import shard
from ..data import Corpus
from ..models.gpt import GPT, get_preset
from ..observe.trace import lifetime_chart

GROUPINGS = {"per block": "blocks", "size >= 60k": 60_000, "whole model": None}
"""Label -> unit policy: one unit per block, units of at least 60k parameters, the whole
model as one unit."""

#: The lifetime charts ``--out`` gets, one per grouping (the only files written there).
CHARTS = (r"granularity-.+\.png",)


def chart_name(label: str) -> str:
    """The chart file of grouping ``label``."""
    return f"granularity-{label.split()[0]}.png"


def measure(model_name: str, steps: int, batch: int, out: str | None) -> dict:
    """On every rank: GPT ``model_name`` at stage 3, trained ``steps`` steps on global
    batches of ``batch`` once per grouping of ``GROUPINGS`` (and once without a profiler:
    ``_plain_ms``, what a paused profiler costs); per grouping its units, their members,
    the profiled step's gathers and reductions and their mean duration, the peak and
    where it falls, the step time and the loss. With ``out``, rank 0 writes a lifetime
    chart per grouping there."""
    cfg = get_preset(model_name)
    corpus = Corpus.builtin()
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * batch // world, (rank + 1) * batch // world)
    results = {}
    torch.manual_seed(0)
    plain = shard(GPT(cfg), stage=3)  # no profiler at all: what profiling off costs
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    plain_times = []
    for step in range(steps):
        x, y = corpus.batch("train", 0, step, batch, cfg.block_size)
        t0 = time.perf_counter()
        plain(x[rows], y[rows]).backward()
        opt.step()
        opt.zero_grad()
        plain_times.append(time.perf_counter() - t0)
    results["_plain_ms"] = 1e3 * statistics.median(plain_times[1:])
    for label, policy in GROUPINGS.items():
        torch.manual_seed(0)
        net = shard(GPT(cfg), stage=3, units=policy, profile=True)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        prof = net.profiler
        times, loss = [], None
        for step in range(steps):
            prof.enabled = step == 2  # one profiled step, once the gather order is known
            x, y = corpus.batch("train", 0, step, batch, cfg.block_size)
            t0 = time.perf_counter()
            loss = net(x[rows], y[rows])
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 2:
                profiled = time.perf_counter() - t0
            elif step:  # the first step records the gather order: not timed
                times.append(time.perf_counter() - t0)
        prof.enabled = False
        step_coll = [c for c in prof.collectives if c.get("done")]
        gathers = [c for c in step_coll if c["kind"] == "all_gather"]
        reduces = [c for c in step_coll if c["kind"] == "reduce_scatter"]
        _, peak = prof.peak()
        if rank == 0 and out:
            lifetime_chart(prof, str(Path(out) / chart_name(label)),
                           f"{label}: {len(net.units)} units, stage 3, N = {world}")
        results[label] = {
            "units": [u.w_layout.numel for u in net.units],
            "members": [", ".join(u.names[:2]) + (f", ... ({len(u.names)} tensors)"
                                                  if len(u.names) > 2 else "")
                        for u in net.units],
            "gathers": len(gathers), "reduces": len(reduces),
            "gather_ms": 1e3 * statistics.mean(c["done"] - c["issued"] for c in gathers),
            "reduce_ms": 1e3 * statistics.mean(c["done"] - c["issued"] for c in reduces),
            "peak": prof.total(peak), "peak_at": prof.phase_at(prof.peak()[0]),
            "step_ms": 1e3 * statistics.median(times), "profiled_ms": 1e3 * profiled,
            "loss": loss.item(),
        }
    return results
