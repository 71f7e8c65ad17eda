"""zeroshard against the anchors, side by side, in one run.

    python bench/compare.py                       # medium GPT preset, N = 2, 20 steps
    python bench/compare.py --preset tiny --steps 4 --impl zeroshard-3,ddp,fsdp2-reshard

Every implementation trains the built-in GPT benchmark preset from the same initial
weights on the same global batches (AdamW, fp32; ``--optimizer muon`` or ``adafactor``
instead), each in fresh processes:
zeroshard stages 0-3; torch DDP; DDP + ZeroRedundancyOptimizer; FSDP2 ``fully_shard``
per block with ``reshard_after_forward`` True and False; with activation checkpointing
(``zeroshard-S-ac-full``, ``-ac-selective``; FSDP2 with torch's ``checkpoint_wrapper`` on
each block, ``fsdp2-reshard-ac``, or its selective policy, ``fsdp2-reshard-sac``);
zeroshard compiled by
torch.compile's inductor (``zeroshard-S-compile``: the sharded model whole;
``zeroshard-S-compile-units``: each unit's forward); DeepSpeed stages 1-3 when it
is installed (``pip install deepspeed``; on CPU it runs with DS_ACCELERATOR=cpu over
gloo); and a "limit": one process, its local micro-batch, no communication at all.

Each implementation runs ``--rounds`` times (default 2), round-robin, and its timed steps
are pooled. Reported per implementation: median step time and its spread (interquartile
range), the ratio of zeroshard's median to each anchor's, peak memory growth per rank —
live (heap bytes in use, sampled through the warm-up steps; see ``heap.py``) and
resident (``ru_maxrss``, which also counts what the allocator keeps after frees) —,
model-state bytes per rank (weights, gradients and optimizer state it holds), bytes sent
per step in ring accounting, and the loss after the last step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

from heap import HeapPeak

ANCHORS = ["ddp", "ddp+zero", "fsdp2-noreshard", "fsdp2-reshard"]
OURS = [f"zeroshard-{s}" for s in range(4)]
DEEPSPEED = [f"deepspeed-{s}" for s in (1, 2, 3)]
#: which anchor each zeroshard stage is held against
#: steps left out of the timing (and the only ones the heap sampler runs in)
WARMUP = 3
TARGETS = {"zeroshard-0": ["ddp"], "zeroshard-1": ["ddp+zero"],
           "zeroshard-2": ["fsdp2-noreshard", "deepspeed-2"],
           "zeroshard-3": ["fsdp2-reshard", "deepspeed-3"],
           "zeroshard-3-tp2": ["fsdp2-tp2"]}
#: tensor parallelism of degree 2 (the GPT's TP_PLAN, torch's styles) inside the pairs of
#: consecutive ranks, the data-parallel implementation across them
TP = 2


def data_rows(impl: str, rank: int, world: int, batch: int) -> slice:
    """This rank's rows of a global batch: by data-parallel rank, so the ranks of a
    tensor-parallel pair (``-tp2``) read the same rows."""
    if impl.endswith("-tp2"):
        rank, world = rank // TP, world // TP
    return slice(rank * batch // world, (rank + 1) * batch // world)


def _tp_mesh(model):
    """A (world / 2, 2) mesh named ("dp", "tp"), ``model`` parallelized on its tp dim."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from zeroshard.models.gpt import GPT
    from zeroshard.models.tpplan import parallelize

    mesh = init_device_mesh("cpu", (dist.get_world_size() // TP, TP),
                            mesh_dim_names=("dp", "tp"))
    parallelize(model, mesh["tp"], GPT.TP_PLAN)
    return mesh


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state(impl, net, model, opt) -> int:
    """Bytes of weights, gradients and optimizer state this rank holds."""
    import torch

    if impl.startswith("zeroshard"):
        mem = net.memory(getattr(opt, "opts", opt))
        return mem["params"] + mem["grads"] + mem["optimizer"] + mem["padding"]
    local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    grads = [getattr(p.grad, "_local_tensor", p.grad) for p in model.parameters()
             if p.grad is not None]
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps this rank's states
    states = [getattr(v, "_local_tensor", v) for s in getattr(inner, "state", {}).values()
              for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return _bytes(local) + _bytes(grads) + _bytes(states)


#: ``--optimizer``: AdamW everywhere (the default), Muon for the 2-D parameters with
#: AdamW for the rest (torch's documented use), or Adafactor
OPTIMIZERS = ("adamw", "muon", "adafactor")
#: Muon's learning rate (Keller Jordan's; torch's docs use it too)
MUON_LR = 0.02


class Optimizers:
    """Several torch optimizers over disjoint parameters, stepped as one."""

    def __init__(self, opts):
        self.opts = opts

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()

    def register_step_pre_hook(self, hook):
        return self.opts[0].register_step_pre_hook(lambda o, a, k: hook(self, a, k))

    @property
    def state(self) -> dict:
        return {p: s for o in self.opts for p, s in o.state.items()}


def make_optimizer(kind: str, named, lr: float):
    """``kind``'s optimizer over ``named`` (name, parameter) pairs: AdamW at ``lr``;
    Muon (at ``MUON_LR``) for the 2-D parameters and AdamW for the rest; Adafactor."""
    import torch

    params = [p for _, p in named if p.requires_grad]
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if kind == "muon":
        return Optimizers([torch.optim.Muon([p for p in params if p.ndim == 2], lr=MUON_LR),
                           torch.optim.AdamW([p for p in params if p.ndim != 2], lr=lr)])
    if kind == "adafactor":
        return torch.optim.Adafactor(params, lr=lr)
    raise ValueError(f"optimizer {kind!r}; expected one of {', '.join(OPTIMIZERS)}")


def _checkpoint_blocks(model, selective: bool) -> None:
    """torch's ``checkpoint_wrapper`` (non-reentrant) around each block, as torchtitan
    applies activation checkpointing before ``fully_shard``; ``selective``: the matrix
    multiplications' outputs kept (the policy zeroshard's "selective" mode uses)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    from zeroshard.runtime.checkpointing import selective_context

    extra = {"context_fn": selective_context} if selective else {}
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                             **extra)


def build(impl: str, model, lr: float, batch: int, prefetch: int | None = None,
          reduce_bucket_size: int | None = None, optimizer: str = "adamw"):
    """Wrap ``model`` (on every rank, from the same weights) as implementation ``impl``.

    Returns ``(net, optimizer, engine, comm)``: ``net(x, y)`` gives the loss; ``engine``
    is DeepSpeed's (which runs backward and step itself) or None; ``comm`` is the bytes
    an anchor sends per rank per step in ring accounting (None for zeroshard, whose
    ledger counts them). ``prefetch`` and ``reduce_bucket_size`` are zeroshard's
    (None: the engine's defaults). ``optimizer``: one of ``OPTIMIZERS`` (DeepSpeed and
    ZeroRedundancyOptimizer take AdamW only here)."""
    if optimizer != "adamw" and impl.startswith(("deepspeed", "ddp+zero")):
        raise ValueError(f"{impl} is built with AdamW only; --optimizer {optimizer} runs "
                         "zeroshard, ddp, fsdp2 and limit")
    import torch
    import torch.distributed as dist

    from zeroshard.plan.memory import ring_all_reduce, ring_one_way

    world = dist.get_world_size() if dist.is_initialized() else 1
    P = sum(p.numel() for p in model.parameters())
    comm = None
    engine = None
    if impl.startswith("zeroshard"):
        import zeroshard as zs

        options = {k: v for k, v in (("prefetch", prefetch),
                                     ("reduce_bucket_size", reduce_bucket_size)) if v is not None}
        if impl.endswith("-unchecked"):  # the engine without its run-time checks
            options["config"] = {"check_collectives": False, "nonfinite": "ignore"}
        elif impl.endswith("-nofingerprints"):  # without the fingerprints only
            options["config"] = {"check_collectives": False}
        elif impl.endswith("-perunit"):  # one reduction per unit (stage 0's default:
            options["reduce_bucket_size"] = 0  # DDP's 25 MiB bucket)
        elif impl.endswith("-hybrid2"):  # shard groups of 2, replicated across
            options["shard_group"] = 2
        elif impl.endswith("-hpz2"):  # ZeRO++ hpZ: backward gathers in groups of 2
            options["secondary_group"] = 2
        elif impl.endswith("-tp2"):  # beside tensor parallelism on a (dp, tp) mesh
            options["mesh"] = _tp_mesh(model)
        elif "-ac-" in impl:  # activation checkpointing: -ac-full, -ac-selective
            options["activation_checkpointing"] = impl.split("-ac-")[1]
        net = zs.shard(model, stage=int(impl.split("-")[1]), **options)
        opt = make_optimizer(optimizer, net.named_parameters(), lr)
        if impl.endswith("-compile-units"):  # each unit's forward (torchtitan's way)
            net.compile()
        elif impl.endswith("-compile"):  # the sharded model whole, units as graph borders
            net = torch.compile(net)
    elif impl in ("ddp", "ddp+zero"):
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
        if impl == "ddp":
            opt = make_optimizer(optimizer, model.named_parameters(), lr)
            comm = ring_all_reduce(4 * P, world)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                          lr=lr)
            comm = ring_all_reduce(4 * P, world) + ring_one_way(4 * P, world)  # + broadcast
    elif impl.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        reshard = impl in ("fsdp2-reshard", "fsdp2-hsdp2", "fsdp2-tp2", "fsdp2-reshard-ac",
                           "fsdp2-reshard-sac")
        if impl.endswith(("-ac", "-sac")):  # torch's checkpoint_wrapper on each block first
            _checkpoint_blocks(model, selective=impl.endswith("-sac"))
        mesh = None
        if impl == "fsdp2-tp2":  # FSDP2 + TP (torchtitan's): fully_shard on the dp dim
            mesh = _tp_mesh(model)["dp"]
        if impl == "fsdp2-hsdp2":  # HSDP: shard over 2, replicate across world / 2
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world // 2, 2),
                                    mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        net, opt = model, make_optimizer(optimizer, model.named_parameters(), lr)
        comm = (3 if reshard else 2) * ring_one_way(4 * P, world)
        if impl == "fsdp2-hsdp2":  # inside the pairs: gathers and reduce-scatters;
            # across: one all-reduce of each reduced half
            comm = 3 * ring_one_way(4 * P, 2) + ring_all_reduce(2 * P, world // 2)
        elif mesh is not None:  # its ZeRO-3 over the dp ranks, of about 1/tp (TP's own
            comm = 3 * ring_one_way(4 * P // TP, world // TP)  # collectives left out)
    elif impl.startswith("deepspeed"):
        import deepspeed

        stage = int(impl.split("-")[1])
        zero = {"stage": stage}
        if impl.endswith("-hpz2"):  # ZeRO++ hpZ (its MiCS is removed in 0.19)
            zero["zero_hpz_partition_size"] = 2
        config = {"train_micro_batch_size_per_gpu": batch // world,
                  "gradient_accumulation_steps": 1, "zero_optimization": zero}
        # the same torch AdamW as everyone else, so all train the same function
        engine, opt, _, _ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=lr), config=config)
        net = engine
        comm = (3 if stage == 3 else 2) * ring_one_way(4 * P, world)
    elif impl == "limit":
        net, opt = model, make_optimizer(optimizer, model.named_parameters(), lr)
        comm = 0
    else:
        raise ValueError(f"unknown implementation {impl!r}")

    return net, opt, engine, comm


def _rank(impl: str, preset: str, steps: int, batch: int, lr: float, ranks: int,
          prefetch: int | None = None, optimizer: str = "adamw") -> dict:
    import torch
    import torch.distributed as dist

    from zeroshard.data import Corpus
    from zeroshard.models.gpt import GPT, get_preset

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = get_preset(preset)
    corpus = Corpus.builtin()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    heap = HeapPeak().start()  # sampled through the untimed warm-up steps only
    torch.manual_seed(0)
    model = GPT(cfg)
    net, opt, engine, comm = build(impl, model, lr, batch, prefetch, optimizer=optimizer)
    rows = data_rows(impl, rank, world, batch)
    if impl == "limit":  # one process standing in for one rank: its local micro-batch
        rows = slice(0, batch // ranks)
    times, loss, held = [], None, []
    for step in range(steps):
        if step == WARMUP:
            heap.stop()
        if step == steps - 1 and engine is None:  # between backward and step: all live
            hook = opt.register_step_pre_hook(
                lambda o, a, k: held.append(_state(impl, net, model, o)))
        x, y = corpus.batch("train", 0, step, batch, cfg.block_size)
        t0 = time.perf_counter()
        loss = net(x[rows], y[rows])
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
        times.append(time.perf_counter() - t0)
    heap.stop()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    if held:
        hook.remove()
    state = held[0] if held else None  # DeepSpeed's flat partitions are not torch-visible
    final = loss.detach().double().reshape(1)
    if world > 1:
        dist.all_reduce(final)
    if impl.startswith("zeroshard"):
        comm = sum(s["bytes"] for s in net.comm_stats().values()) / steps
    warm = times[min(WARMUP, len(times) - 1):]
    q = statistics.quantiles(warm, n=4) if len(warm) >= 2 else [warm[0]] * 3
    return {"median": statistics.median(warm), "iqr": q[2] - q[0], "peak": peak,
            "live": heap.growth, "state": state, "comm": comm, "loss": final.item() / world,
            "times": warm}


def _combine(runs: list[dict]) -> dict:
    """One row from the rounds of one implementation: median and IQR of every timed step
    of every round, the largest peaks; the loss must not depend on the round."""
    if any("error" in r for r in runs):
        return next(r for r in runs if "error" in r)
    times = [t for r in runs for t in r["times"]]
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    losses = {r["loss"] for r in runs}
    if len(losses) > 1:
        return {"error": f"the loss differs between rounds: {sorted(losses)}"}
    peaks = {k: (None if runs[0][k] is None else max(r[k] for r in runs))
             for k in ("peak", "live")}
    return {**runs[0], **peaks, "median": statistics.median(times), "iqr": q[2] - q[0],
            "times": times}


def _mb(value) -> str:
    return "    n/a" if value is None else f"{value / 1e6:7.1f}"


def _row(impl: str, r: dict) -> str:
    if "error" in r:
        return f"{impl:16} failed: {r['error']}"
    return (f"{impl:16} median {r['median'] * 1e3:7.1f} ms  IQR {r['iqr'] * 1e3:5.1f}  "
            f"live peak {_mb(r['live'])} MB  resident peak {_mb(r['peak'])} MB  "
            f"state {_mb(r['state'])} MB  comm {r['comm'] / 1e6:6.2f} MB/step  "
            f"loss {r['loss']:.6f}")


def _ratio(ours: dict, anchor: dict, key: str) -> str:
    if ours[key] is None or not anchor[key]:
        return "n/a"
    return f"{ours[key] / anchor[key]:.2f}x"


def main() -> None:
    from zeroshard.runtime.spawn import RankFailure, spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="medium")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--impl", help="comma-separated subset (default: all available)")
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of every implementation, interleaved; the timed steps of all "
                        "rounds are pooled (default 2)")
    p.add_argument("--prefetch", type=int, metavar="K",
                   help="zeroshard's stage-3 prefetch depth (default: the engine's, 1)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="the optimizer every implementation steps (default adamw; muon: "
                        f"Muon at lr {MUON_LR} for the 2-D parameters, AdamW for the rest)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    a = p.parse_args()
    if a.rounds < 1:
        p.error(f"--rounds={a.rounds} must be at least 1")
    try:
        import deepspeed  # noqa: F401

        have_ds = True
    except Exception:  # noqa: BLE001 - any failure to import means: not available
        have_ds = False
    impls = (a.impl.split(",") if a.impl else
             OURS + ANCHORS + (DEEPSPEED if have_ds else []) + ["limit"])
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    runs: dict[str, list[dict]] = {impl: [] for impl in impls}
    # Round-robin: every implementation once per round, so a slow spell of the machine
    # falls on all of them rather than on whichever happened to run then.
    for k in range(a.rounds):
        for impl in impls:
            n = 1 if impl == "limit" else a.nproc
            try:
                r = spawn(_rank, n, impl, a.preset, a.steps, a.batch, a.lr, a.nproc,
                          a.prefetch, a.optimizer, timeout=900)[0]
            except RankFailure as exc:
                r = {"error": str(exc).splitlines()[-1][:120]}
            runs[impl].append(r)
            if a.rounds > 1:
                print(f"round {k + 1}/{a.rounds}  {_row(impl, r)}", flush=True)
    results = {impl: _combine(rs) for impl, rs in runs.items()}
    print()
    for impl, r in results.items():
        print(_row(impl, r))
    print()
    for ours, anchors in TARGETS.items():
        if ours not in results or "error" in results[ours]:
            continue
        line = [f"{ours}:"]
        for anchor in anchors + ["limit"]:
            r = results.get(anchor)
            if r and "error" not in r:
                line.append(f"{_ratio(results[ours], r, 'median')} {anchor} (live peak "
                            f"{_ratio(results[ours], r, 'live')}, resident "
                            f"{_ratio(results[ours], r, 'peak')})")
        print("  ".join(line))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
