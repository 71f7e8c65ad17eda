"""zeroshard bench granularity — how the unit grouping shapes a stage-3 run.

The source document's exercise: the same model, N, global batch and reshard policy,
grouped into units several ways — one unit per block, units of at least a given size,
the whole model as one unit. For each: unit membership and bytes, gathers and
reductions per step, their mean duration, the measured peak, the step time, and the
loss (which must not depend on the grouping). With --out, a lifetime chart per
grouping goes into that folder.

example:
  zeroshard bench granularity --model small --steps 8 --out runs/granularity
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from .._paths import claim, folder, record
from ..models.gpt import PRESETS
from ..runtime.spawn import spawn
from ..train.granularity import CHARTS, chart_name, measure


def _fits(args) -> None:
    """Refuse a --batch or --nproc whose ranks cannot fit this machine's memory (the
    trainer's check, ``train/hostmem.py``, on the same model at stage 3)."""
    from ..train import hostmem
    from ..train.hfmodel import BuiltinGPT
    from ..train.settings import TrainConfig

    cfg = TrainConfig(nproc=args.nproc, model=args.model, batch=args.batch, sample_chars=0)
    hostmem.check(cfg, BuiltinGPT(cfg), spell=lambda name: f"--{name}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=("granularity",), help="the benchmark to run")
    p.add_argument("--model", default="small", help="GPT preset (default small)")
    p.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    p.add_argument("--steps", type=int, default=8, help="steps per grouping (default 8)")
    p.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    p.add_argument("--out", metavar="DIR", help="write a lifetime chart per grouping into "
                                                "this folder (default: no charts)")


def run(args) -> int:
    if args.model not in PRESETS:
        raise ValueError(f"--model={args.model!r}; expected one of {', '.join(PRESETS)}")
    for name in ("nproc", "batch"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name}={getattr(args, name)} must be positive")
    if args.batch % args.nproc:
        raise ValueError(f"--batch={args.batch} does not divide over --nproc={args.nproc}")
    if args.steps < 4:
        raise ValueError(f"--steps={args.steps}; at least 4 (one records the order, one is "
                         "profiled, the rest are timed)")
    if args.out:  # the charts it writes there replace only charts it wrote
        folder("--out", args.out)
        claim("--out", args.out, (), CHARTS)
    _fits(args)
    res = spawn(measure, args.nproc, args.model, args.steps, args.batch, args.out, timeout=900)[0]
    if args.out:
        record(args.out, [chart_name(label) for label in res if not label.startswith("_")])
    plain_ms = res.pop("_plain_ms")
    t = Table(title=f"unit granularity: GPT {args.model}, stage 3, N = {args.nproc}, global "
                    f"batch {args.batch}, prefetch 1 (rank 0)", title_justify="left")
    for col in ("grouping", "units", "largest", "AG/step", "RS/step", "AG ms", "RS ms",
                "peak MB", "peak at", "step ms", "profiled", "loss"):
        t.add_column(col, justify="left" if col in ("grouping", "peak at") else "right")
    for label, r in res.items():
        t.add_row(label, str(len(r["units"])), f"{max(r['units']):,}", str(r["gathers"]),
                  str(r["reduces"]), f"{r['gather_ms']:.2f}", f"{r['reduce_ms']:.2f}",
                  f"{r['peak'] / 1e6:.2f}", r["peak_at"], f"{r['step_ms']:.1f}",
                  f"{r['profiled_ms']:.1f}",
                  f"{r['loss']:.6f}")
    console = Console(highlight=False, width=max(Console().width, 130))
    console.print(t)
    for label, r in res.items():
        console.print(f"{label}: " + "; ".join(
            f"unit {k} {n * 4 / 1e6:.3f} MB [{m}]" for k, (n, m) in
            enumerate(zip(r["units"], r["members"]))), markup=False)
    losses = [r["loss"] for r in res.values()]
    console.print(f"loss spread across groupings: {max(losses) - min(losses):.2e}; AG/RS: "
                  "all-gathers and reduce-scatters in the profiled step, mean issue-to-done "
                  "time; step ms: median with profiling off, profiled: the one step with it on"
                  + (f"; charts in {args.out}" if args.out else ""))
    paused = res["per block"]["step_ms"]
    console.print(f"a paused profiler: per block, a model built without a profiler steps in "
                  f"{plain_ms:.1f} ms, one with its profiler paused in {paused:.1f} ms "
                  f"({paused / plain_ms:.2f}x)")
    return 0
