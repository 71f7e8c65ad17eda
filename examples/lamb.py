"""Would ZeRO-1 still be exact with an optimizer that normalizes by the norm of the whole
gradient, like LAMB? (The question the source document ends on.)

Run: python examples/lamb.py [--nproc 2] [--steps 20] [--params 10]

The source document's experiment: a linear regression of P weights, each of N ranks
fitting its own slice of the data, trained as DDP and as ZeRO-1 - now with LAMB (You et
al., 2019), whose step scales Adam's update u of each tensor by ||w|| / ||u||.

Predict first:

1. *Naive slicing.* Rank r steps its rows alone, with LAMB computing ||w|| and ||u||
   over the rows it holds. Is the result DDP's? (Adam's part is elementwise; the two
   norms are not: each rank scales its rows by its own ratio.)
2. *The reduced norm.* A norm is the square root of a sum of squares, and a sum over
   all rows is the sum of each rank's partial sums: one all-reduce of two floats per
   parameter gives every rank the whole norms. Is that ZeRO-1 DDP's result?
3. What does that all-reduce cost per step, next to the gradients' reduce-scatter?

Then check: the first line below is naive slicing (zeroshard cannot tell what a
subclass of Lamb does, warns, and lets it step the rows as it is), the second is
``zs.shard(..., stage=1)`` with ``zeroshard.optim.Lamb``, which the engine steps with
the norms all-reduced (``runtime/whole.py``).
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import zeroshard as zs
from zeroshard.optim import Lamb
from zeroshard.runtime.spawn import spawn


class NaiveLamb(Lamb):
    """LAMB as written for one process: on a shard it takes the rows' norms."""


def experiment(params: int, steps: int) -> dict:
    class LinearRegression(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(params))

        def forward(self, x):
            return x @ self.w

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    w_true = torch.randn(params, generator=g)
    x = torch.randn(16 * world, params, generator=g)
    y = x @ w_true + 0.01 * torch.randn(16 * world, generator=g)
    x, y = x[rank * 16:(rank + 1) * 16], y[rank * 16:(rank + 1) * 16]  # this rank's data
    out = {}
    for label, stage, cls in (("ddp", 0, Lamb), ("naive", 1, NaiveLamb), ("zero1", 1, Lamb)):
        model = zs.shard(LinearRegression(), stage=stage, units=None)
        opt = cls(model.parameters(), lr=0.05, weight_decay=0.01)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                ((model(x) - y) ** 2).mean().backward()
                model.comm_stats(reset=True)
                opt.step()
                opt.zero_grad()
        out[label] = model.full_state_dict()["w"]
        out[label + " warned"] = [str(w.message) for w in caught]
        out[label + " step bytes"] = model.comm_stats()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--params", type=int, default=10)
    args = p.parse_args()
    r = spawn(experiment, args.nproc, args.params, args.steps, timeout=300)[0]
    naive = (r["ddp"] - r["naive"]).abs().max().item()
    exact = (r["ddp"] - r["zero1"]).abs().max().item()
    print(f"LAMB, P = {args.params}, N = {args.nproc}, {args.steps} steps:")
    print(f"  naive slicing (each rank its rows' norms): max |w_DDP - w| = {naive:.2e}")
    print(f"  ZeRO-1 with the norms all-reduced:         max |w_DDP - w| = {exact:.2e}")
    if r["naive warned"]:
        print(f"  (the engine said: {r['naive warned'][0]})")
    sent = r["zero1 step bytes"]
    print("  ZeRO-1's step sends, per rank (ring accounting): "
          + ", ".join(f"{k} {v['bytes']} B" for k, v in sent.items() if k != "check"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
