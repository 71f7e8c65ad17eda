"""zeroshard demo — ZeRO-1 is exact: the source documents' experiment on real processes.

A linear regression with P = 10 weights is trained with Adam on N = 4 ranks, each rank
fitting its own slice of the data: once as DDP (stage 0: gradients all-reduced, every
rank steps every weight) and once at each ZeRO stage. Adam is elementwise, so a rank
that owns a slice of the weights can update that slice alone; the weights come out
bit-for-bit equal, while the Adam state summed over all ranks shrinks from N·2P floats
to 2P. Both lines are read off the trained weights and the engine's ledger.
"""

from __future__ import annotations

import argparse

from .._host import PROCESS_BYTES, available_bytes, gb
from ..experiment import experiment
from ..runtime.spawn import spawn


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--steps", type=int, default=50, help="Adam steps (default 50)")
    p.add_argument("--params", type=int, default=10, help="weights P (default 10)")


def run(args) -> int:
    for name in ("nproc", "steps", "params"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name}={getattr(args, name)} must be positive")
    _fits(args.nproc, args.params)
    ranks = spawn(experiment, args.nproc, args.params, args.steps, timeout=300)
    w = ranks[0]["weights"]
    n, p = args.nproc, args.params
    for stage, label in ((1, "ZeRO1"), (2, "ZeRO2"), (3, "ZeRO3")):
        diff = (w[0] - w[stage]).abs().max().item()
        print(f"  max |w_DDP - w_{label}| after {args.steps} steps = {diff:.2e}")
    adam = [sum(r["adam_floats"][s] for r in ranks) for s in range(4)]
    grads = [sum(r["grad_floats"][s] for r in ranks) for s in range(4)]
    print(f"  Adam state floats across all ranks: DDP {adam[0]}, ZeRO-1 {adam[1]}  "
          f"(P = {p}, N = {n})")
    print(f"  gradient floats held across all ranks: DDP {grads[0]}, ZeRO-2 {grads[2]}")
    return 0


def _per_rank(n: int, p: int) -> int:
    """A lower bound of one rank's bytes (``demo.experiment``): every rank draws the data
    of all ``n`` ranks (16 rows each of P fp32 features), the true weights, and for each
    stage the weights, a gradient and Adam's two moments, and keeps each stage's full
    weights to compare."""
    return PROCESS_BYTES + 4 * p * (16 * n + 1 + 4 + 4)


def _fits(n: int, p: int) -> None:
    """Refuse --nproc and --params whose ranks cannot all fit this machine's memory."""
    have = available_bytes()
    need = n * _per_rank(n, p)
    if have is None or need <= have:
        return
    what = f"about {gb(need)} of this machine's memory ({gb(need / n)} on each of {n} ranks)"
    if n * _per_rank(n, 1) > have:
        most = 1
        while (most + 1) * _per_rank(most + 1, 1) <= have:
            most += 1
        raise ValueError(f"--nproc={n} needs {what}; {gb(have)} is available: --nproc="
                         f"{most} is the most that fit")
    most = (have // n - PROCESS_BYTES) // (4 * (16 * n + 9))
    raise ValueError(f"--params={p} needs {what}; {gb(have)} is available: --params={most} is "
                     "the largest that fits")
