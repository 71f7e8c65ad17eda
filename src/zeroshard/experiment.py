"""The source documents' experiment on real processes (``zeroshard demo`` runs it): a
linear regression with P weights trained with Adam on N ranks, each rank fitting its own
slice of the data, once as DDP (stage 0) and once at each ZeRO stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .api import shard


def experiment(params: int, steps: int) -> dict:
    """On every rank: the regression trained ``steps`` Adam steps at each stage 0-3 on
    this rank's data; per stage the full weights, the Adam state floats this rank holds
    and the gradient floats it holds at the step."""

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
        model = shard(LinearRegression(), stage=stage, units=None)
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
