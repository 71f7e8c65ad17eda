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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--steps", type=int, default=50, help="Adam steps (default 50)")
    p.add_argument("--params", type=int, default=10, help="weights P (default 10)")


def _rank_main(params: int, steps: int) -> dict:
    """On every rank: train stage 0-3 models; report weights and Adam state floats."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import zeroshard as zs

    class LinearRegression(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(params))  # 1D: 10 rows over 4 ranks

        def forward(self, x):
            return x @ self.w

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    w_true = torch.randn(params, generator=g)
    x = torch.randn(16 * world, params, generator=g)
    y = x @ w_true + 0.01 * torch.randn(16 * world, generator=g)
    x, y = x[rank * 16:(rank + 1) * 16], y[rank * 16:(rank + 1) * 16]  # this rank's data
    out = {"weights": {}, "adam_floats": {}, "grad_floats": {}}
    for stage in range(4):
        model = zs.shard(LinearRegression(), stage=stage, units=None)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        for _ in range(steps):
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            # the gradients the step will use: read after backward, before step() and
            # zero_grad() let them go
            held = model.memory(opt)["grads"]
            opt.step()
            opt.zero_grad()
        mem = model.memory(opt)
        out["weights"][stage] = model.full_state_dict()["w"]
        out["adam_floats"][stage] = mem["optimizer"] // 4  # fp32: no master, only m and v
        out["grad_floats"][stage] = held // 4
    return out


def run(args) -> int:
    from .runtime.spawn import spawn

    for name in ("nproc", "steps", "params"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name}={getattr(args, name)} must be positive")
    ranks = spawn(_rank_main, args.nproc, args.params, args.steps, timeout=300)
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
