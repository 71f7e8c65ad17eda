"""The shared library of the optimizer tests (``test_optimizers.py``): Muon with AdamW,
Adafactor and LAMB trained by torch DDP and by zeroshard on the same batches, and the
grids each spawn runs (importable by name, so the spawned ranks can unpickle them)."""

from __future__ import annotations

import torch
import torch.nn as nn

import zeroshard as zs
from zeroshard.optim import Lamb

from . import engine_cases as cases

STEPS = 20


def make_optimizers(kind: str, named) -> list:
    """The optimizers of ``kind`` over ``named`` (name, parameter) pairs: Muon for the
    2-D parameters and AdamW for the rest (torch's documented use), or one Adafactor or
    LAMB over everything."""
    named = [(n, p) for n, p in named if p.requires_grad]
    if kind == "muon":
        return [torch.optim.Muon([p for _, p in named if p.dim() == 2], lr=0.02),
                torch.optim.AdamW([p for _, p in named if p.dim() != 2], lr=1e-3,
                                  weight_decay=0.1)]
    params = [p for _, p in named]
    if kind == "adafactor":
        return [torch.optim.Adafactor(params, lr=1e-2, weight_decay=0.01)]
    if kind == "lamb":
        return [Lamb(params, lr=1e-2, weight_decay=0.01)]
    raise AssertionError(kind)


def train(model_name: str, stage, kind: str, steps: int = STEPS, precision=None,
          shard_group=None, clip: float | None = None, micros: int = 1, offload=None,
          net=None, opts=None, start: int = 0):
    """Train with zeroshard (stage 0-3) or torch DDP (stage "ddp") under optimizers of
    ``kind``; return the full weights, the model and the optimizers."""
    if net is None:
        model = cases.build(model_name)
        if stage == "ddp":
            net = nn.parallel.DistributedDataParallel(model)
            opts = make_optimizers(kind, model.named_parameters())
        else:
            net = zs.shard(model, stage=stage, mixed_precision=precision,
                           shard_group=shard_group, offload=offload)
            opts = make_optimizers(kind, net.named_parameters())
    for step in range(start, start + steps):
        for micro in range(micros):
            x, y = cases.batch(model_name, step, micro, micros)
            last = micro == micros - 1
            ctx = net.no_sync() if stage == "ddp" and not last else cases._null()
            with ctx:
                (net(x, y) / micros).backward()
        if clip is not None:
            if stage == "ddp":
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            else:
                net.clip_grad_norm_(clip)
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()
    if stage == "ddp":
        weights = {k: v.detach().clone() for k, v in net.module.state_dict().items()}
    else:
        weights = net.full_state_dict()
    return weights, net, opts
