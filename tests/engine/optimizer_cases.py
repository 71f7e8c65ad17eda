"""The shared library of the optimizer tests (``test_optimizers.py``): Muon with AdamW,
Adafactor and LAMB trained by torch DDP and by zeroshard on the same batches, and the
grids each spawn runs (importable by name, so the spawned ranks can unpickle them)."""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.distributed as dist
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


def _batch(model_name, step, micro, micros, replicated):
    if replicated:  # every rank the whole global batch: sums free of their order
        return cases.batch(model_name, step, micro, micros, rank=0, world=1)
    return cases.batch(model_name, step, micro, micros)


def train(model_name: str, stage, kind: str, steps: int = STEPS, precision=None,
          shard_group=None, clip: float | None = None, micros: int = 1, offload=None,
          replicated: bool = False, net=None, opts=None, start: int = 0, group=None,
          check: bool = False):
    """Train with zeroshard (stage 0-3) or torch DDP (stage "ddp") under optimizers of
    ``kind``; return the full weights, the model and the optimizers. ``check``: the
    collectives' fingerprints (off where only the numbers are asked about)."""
    if net is None:
        model = cases.build(model_name)
        if stage == "ddp":
            net = nn.parallel.DistributedDataParallel(model)
            opts = make_optimizers(kind, model.named_parameters())
        else:
            net = zs.shard(model, stage=stage, mixed_precision=precision, group=group,
                           shard_group=shard_group, offload=offload,
                           config={"check_collectives": check})
            opts = make_optimizers(kind, net.named_parameters())
    for step in range(start, start + steps):
        for micro in range(micros):
            x, y = _batch(model_name, step, micro, micros, replicated)
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


def parity_grid(models, kinds, stages, replicated=False):
    """Per (model, optimizer, stage): the max relative difference to torch DDP after
    ``STEPS`` steps; stage ``"hybrid"`` is stage 3 over shard groups of 2."""
    out = {}
    for m in models:
        for k in kinds:
            ddp = train(m, "ddp", k, replicated=replicated)[0]
            for s in stages:
                hybrid = s == "hybrid"
                w = train(m, 3 if hybrid else s, k, shard_group=2 if hybrid else None,
                          replicated=replicated)[0]
                out[(m, k, s)] = {"ddp": cases.max_rel_diff(w, ddp)}
    return out


def features_grid(steps: int = 8):
    """Muon with AdamW on the GPT under each engine feature, against the run the maths
    says it equals bit for bit: bf16 stage 3 against bf16 stage 0; two micro-batches at
    stage 1 (which accumulates locally, then reduces) against torch DDP under no_sync;
    clipping at stage 3 against clipping at stage 0 (the same global norm at every
    stage); host offload against none. Adafactor: all of them at once against DDP."""
    out = {}
    bf16 = {s: train("gpt", s, "muon", steps, precision="bf16")[0] for s in (0, 3)}
    out["bf16"] = cases.bit_equal(bf16[3], bf16[0])
    out["accumulate"] = cases.bit_equal(train("gpt", 1, "muon", steps, micros=2)[0],
                                        train("gpt", "ddp", "muon", steps, micros=2)[0])
    clipped = {s: train("gpt", s, "muon", steps, clip=0.05)[0] for s in (0, 3)}
    out["clip"] = cases.bit_equal(clipped[3], clipped[0])
    out["offload"] = cases.bit_equal(
        train("gpt", 1, "muon", steps, precision="bf16", offload="optimizer")[0], bf16[0])
    out["adafactor"] = cases.max_rel_diff(
        train("gpt", 2, "adafactor", steps, micros=2, clip=0.05, offload="optimizer")[0],
        train("gpt", "ddp", "adafactor", steps, micros=2, clip=0.05)[0])
    return out


def ledger_grid():
    """Bytes held and sent, against the planner: the optimizer category under Muon with
    AdamW and under Adafactor at stages 0-3, and the bytes one step sends for Muon's
    owner computes and Adafactor's sums, by this rank."""
    from zeroshard.plan.arch import ModelSpec
    from zeroshard.plan.comm import owner_comm, reduction_comm
    from zeroshard.plan.placement import model_state_bytes
    from zeroshard.spec.dims import ParallelDims

    spec = ModelSpec.from_module(cases.build("mlp"))
    dims = ParallelDims(dist.get_world_size())
    out = {}
    for kind in ("muon", "adafactor"):
        for stage in range(4):
            for precision in (None, "bf16"):
                _, net, opts = train("mlp", stage, kind, 1, precision=precision, check=True)
                net.comm_stats(reset=True)
                train("mlp", stage, kind, 1, net=net, opts=opts, start=1)
                config = dataclasses.replace(
                    net.zero_config, mixed_precision=net.zero_config.recipe.with_optimizer(kind))
                sent = net.comm_stats()
                out[(kind, stage, precision)] = {
                    "memory": net.memory(opts)["optimizer"],
                    "plan": model_state_bytes(spec.params, dims, config,
                                              shapes=list(spec.shapes))[2],
                    "owner": {k: sent.get(k, {}).get("bytes", 0)
                              for k in ("owner_gather", "owner_scatter")},
                    "owner_plan": owner_comm(list(spec.shapes), dims, config,
                                             rank=net.mesh.shard_rank),
                    "sums": sent.get("all_reduce", {}).get("bytes", 0),
                    "sums_plan": reduction_comm(list(spec.shapes), dims, config),
                }
    return out


def checkpoint_grid(root: str):
    """A Muon + AdamW run and an Adafactor run saved at stage 1 after 3 steps, then 3
    more steps; loaded at stage 3 (the same N) they continue bit for bit."""
    out = {}
    for kind in ("muon", "adafactor"):
        path = os.path.join(root, kind)
        _, net, opts = train("gpt", 1, kind, 3)
        zs.save(net, opts, path)
        whole = train("gpt", 1, kind, 3, net=net, opts=opts, start=3)[0]
        model = zs.shard(cases.build("gpt"), stage=3)
        fresh = make_optimizers(kind, model.named_parameters())
        zs.load(model, fresh, path)
        resumed = train("gpt", 3, kind, 3, net=model, opts=fresh, start=3)[0]
        out[kind] = cases.bit_equal(resumed, whole)
    return out


def reshard_grid(root: str):
    """N = 4: a checkpoint saved at stage 2 loaded by two groups of 2 ranks at stage 1
    and by each rank alone (stage 3, whole parameters), saved again: every tensor of
    the optimizer state comes back bit for bit."""
    rank = dist.get_rank()
    out = {}
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    alone = [dist.new_group([r]) for r in range(4)]
    for kind in ("muon", "adafactor"):
        first = os.path.join(root, f"{kind}-n4")
        _, net, opts = train("gpt", 2, kind, 3)
        zs.save(net, opts, first)
        for label, group, stage, writers in (("n2", halves[rank // 2], 1, 2),
                                             ("n1", alone[rank], 3, 1)):
            model = zs.shard(cases.build("gpt"), stage=stage, group=group)
            fresh = make_optimizers(kind, model.named_parameters())
            zs.load(model, fresh, first)
            again = os.path.join(root, f"{kind}-{label}")
            if rank < writers:  # the first group of each layout writes it
                zs.save(model, fresh, again)
            dist.barrier()
            out[(kind, label)] = full_checkpoint(again) if rank == 0 else None
        out[(kind, "n4")] = full_checkpoint(first) if rank == 0 else None
    return out


def full_checkpoint(path: str) -> dict:
    """Every tensor of a checkpoint, rows joined in row order (whole states and scalars
    as one file holds them): what it says whatever N wrote it."""
    import json

    from zeroshard.checkpoint.tensorfile import TensorFile

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    pieces: dict = {}
    for fname in files:
        f = TensorFile(os.path.join(path, fname))
        rows = json.loads(f.metadata["rows"])
        whole = set(json.loads(f.metadata.get("whole", "[]")))
        for key in f.keys():
            name = key.split("::")[0]
            if key.startswith("__") or key.endswith("::buffer"):
                continue
            if not f.shape(key) or key in whole:
                pieces.setdefault(key, [(0, f.rows(key))])
            else:
                pieces.setdefault(key, []).append((rows[name][0], f.rows(key)))
    return {k: torch.cat([t.reshape(t.shape if t.dim() else (1,)) for _, t in sorted(
        v, key=lambda p: p[0])]) for k, v in pieces.items()}


class LAMB(torch.optim.Optimizer):
    """A third-party LAMB: its trust ratio inside its own step, out of the engine's reach."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        return None


def misuse_grid():
    """Refusals and the edge of several optimizers, on the MLP."""
    out = {}
    x, y = cases.batch("mlp", 0)

    attempt = functools.partial(cases.refusal, out)

    for stage, cls in ((1, LAMB), (3, LAMB), (0, LAMB), (2, torch.optim.LBFGS)):
        net = zs.shard(cases.build("mlp"), stage=stage)
        opt = cls(net.parameters(), lr=1e-2)
        net(x, y).backward()
        closure = (lambda net=net: net(x, y)) if cls is torch.optim.LBFGS else None
        attempt((stage, cls.__name__), lambda opt=opt, c=closure: opt.step(c))
    # two optimizers holding one parameter: each gradient is stepped once
    net = zs.shard(cases.build("mlp"), stage=2)
    params = list(net.parameters())
    both = [torch.optim.AdamW(params, lr=0.1), torch.optim.SGD(params[:2], lr=0.1)]
    net(x, y).backward()
    attempt("overlap", lambda: [o.step() for o in both])
    # an optimizer over part of the model: the next forward settles the rest
    for stage in (0, 2):
        runs = {}
        for name in ("ddp", stage):
            model = cases.build("mlp")
            wrapped = (nn.parallel.DistributedDataParallel(model) if name == "ddp"
                       else zs.shard(model, stage=stage))
            named = model.named_parameters() if name == "ddp" else wrapped.named_parameters()
            opt = torch.optim.AdamW([p for n, p in named if "blocks" in n], lr=1e-2)
            for step in range(3):
                bx, by = cases.batch("mlp", step)
                wrapped(bx, by).backward()
                opt.step()
                opt.zero_grad()
                if name != "ddp":
                    runs["state"] = wrapped.cycle.state.value
            runs[name] = ({k: v.detach().clone() for k, v in model.state_dict().items()}
                          if name == "ddp" else wrapped.full_state_dict())
        out[("part", stage)] = (cases.max_rel_diff(runs[stage], runs["ddp"]), runs["state"])
    return out


def lamb_example():
    """``examples/lamb.py``'s experiment on these ranks: DDP, naive slicing, ZeRO-1."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "lamb.py"
    spec = importlib.util.spec_from_file_location("lamb_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.experiment(10, 20)
