"""zeroshard against an anchor, step by step in the same processes: the step-time ratio
with a confidence interval.

    python bench/paired.py                          # the four targets, medium GPT, N = 2
    python bench/paired.py --pairs zeroshard-0:ddp --steps 80
    python bench/paired.py --runs 3 --steps 30      # the four targets' medians of three
    python bench/paired.py --pairs zeroshard-3-compile:zeroshard-3   # compiled / eager

``compare.py`` runs each implementation in fresh processes, one after another, and this
machine's speed drifts between runs by more than the gaps between the closest pairs (its
rounds of the same implementation differ by about 5 %, once by 15 %). Here both members
of a pair live in the same ranks, built from the same initial weights, and take turns:
step k of one, then step k of the other, on the same global batch, the order swapped
every step so neither always runs first. A slow spell then falls on both members of a
step, and the ratio of their two times cancels it. A step is timed on rank 0 until its
communication is done: zeroshard's stages 1-2 leave their post-step all-gathers in
flight for the next forward to wait on, which here would run in the other member's time,
so they are finished inside the step (``ShardedModel.synchronize()``). Reported per
pair: each member's median step time, the median of the per-step ratios and a 95 %
bootstrap interval for it (the timed steps resampled 2,000 times, seeded: the spread of
steps within one run, not between runs), and both losses after the last step, which must
agree: both members train the same function (a pair whose losses differ is reported, and
the command exits with status 1). One run's interval can miss the next run's ratio by a
few per cent when the machine is busy: ``--runs K`` runs every pair K times, each in
fresh processes and the pairs taking turns, and reports the median of the K ratios with
their spread, the measure the project's speed targets are stated in.

A member may name its optimizer, ``IMPL@OPTIMIZER`` (``compare.OPTIMIZERS``; the rest
take ``--optimizer``): ``zeroshard-2@muon:zeroshard-2@adamw`` times Muon's step
(Muon for the 2-D parameters, AdamW for the rest) against AdamW's, and
``zeroshard-2@muon:fsdp2-noreshard@muon`` against FSDP2 stepping torch's Muon on its
local shards. Members with different optimizers train different functions, and FSDP2's
Muon orthogonalises each rank's rows instead of each matrix: their losses are reported,
not required to agree.

Memory: two models share each process, so a process's peak is not either's
(``compare.py`` measures it); reported instead is each member's model state on rank 0 —
the weights, gradients and optimizer state it holds, padding included — read between the
last backward and its step, when all three are live (``compare._state``).

Tensor parallelism: ``-tp2`` members run on a (N / 2, 2) mesh named ("dp", "tp"), the
GPT parallelized with its ``TP_PLAN`` by torch's styles — zeroshard by ``zs.shard(...,
mesh=)``, FSDP2 as torchtitan composes it (``fully_shard`` on the dp dim) — and read
their rows by data-parallel rank; both members of such a pair must be ``-tp2``.
DeepSpeed is left to ``compare.py`` too: its engine is built for one per process. Each
pair runs in fresh processes; implementation names are ``compare.py``'s. A pair of one
implementation with itself (``ddp:ddp``) checks the method: its ratio should be 1.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from compare import OPTIMIZERS, WARMUP, _state, build, data_rows

TARGETS = ["zeroshard-0:ddp", "zeroshard-1:ddp+zero", "zeroshard-2:fsdp2-noreshard",
           "zeroshard-3:fsdp2-reshard", "zeroshard-3-tp2:fsdp2-tp2"]
#: relative loss difference past which a pair did not train the same function
LOSS_TOL = 1e-6
#: the same, for a pair with a compiled member: inductor's fused kernels (its GELU, layer
#: norm and softmax) round differently, and AdamW carries that on (GPT small, 30 steps:
#: 1.1e-5 apart)
LOSS_TOL_COMPILED = 1e-4
PAIRABLE = ({f"zeroshard-{s}{x}" for s in range(4)
             for x in ("", "-unchecked", "-nofingerprints", "-perunit", "-hybrid2", "-compile",
                       "-compile-units", "-tp2", "-ac-full", "-ac-selective")}
            | {"ddp", "ddp+zero", "fsdp2-noreshard", "fsdp2-reshard", "fsdp2-hsdp2",
               "fsdp2-tp2", "fsdp2-reshard-ac", "fsdp2-reshard-sac"})


def _rank(pair: tuple[str, str], preset: str, steps: int, batch: int, lr: float,
          bucket: int | None = None) -> dict:
    import torch
    import torch.distributed as dist

    from zeroshard.data import Corpus
    from zeroshard.models.gpt import GPT, get_preset

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, corpus = get_preset(preset), Corpus.builtin()
    members = []
    for member in pair:
        impl, optimizer = member.split("@")
        torch.manual_seed(0)  # the same initial weights for both
        model = GPT(cfg)
        net, opt, _, _ = build(impl, model, lr, batch, reduce_bucket_size=bucket,
                               optimizer=optimizer)
        members.append((net, opt, model, impl))
    rows = data_rows(pair[0].split("@")[0], rank, world, batch)
    times: list[list[float]] = [[], []]
    losses = [None, None]
    state = [None, None]
    for step in range(steps):
        x, y = corpus.batch("train", 0, step, batch, cfg.block_size)
        for m in ((0, 1) if step % 2 == 0 else (1, 0)):
            net, opt, model, impl = members[m]
            if step == steps - 1:  # between backward and step: all three categories live
                hook = opt.register_step_pre_hook(
                    lambda o, a, k, m=m, net=net, model=model, impl=impl:
                    state.__setitem__(m, _state(impl, net, model, o)))
            t0 = time.perf_counter()
            loss = net(x[rows], y[rows])
            loss.backward()
            opt.step()
            opt.zero_grad()
            if hasattr(net, "synchronize"):
                net.synchronize()
            times[m].append(time.perf_counter() - t0)
            losses[m] = loss.detach()
            if step == steps - 1:
                hook.remove()
    finals = []
    for loss in losses:
        final = loss.double().reshape(1)
        dist.all_reduce(final)
        finals.append(final.item() / world)
    return {"times": [t[WARMUP:] for t in times], "loss": finals,
            "state": state,
            "owner": [_owner_bytes(net, m, steps) for (net, *_), m in zip(members, pair)]}


def _owner_bytes(net, member: str, steps: int) -> dict | None:
    """A zeroshard member under Muon: the owner-computes bytes rank 0 sent per step, as
    its ledger measured them and as the planner counts them (``plan/comm.py``)."""
    if not member.startswith("zeroshard") or not member.endswith("@muon"):
        return None
    import dataclasses

    from zeroshard.plan.arch import ModelSpec
    from zeroshard.plan.comm import owner_comm
    from zeroshard.spec.dims import ParallelDims

    sent = net.comm_stats()
    config = dataclasses.replace(net.zero_config,
                                 mixed_precision=net.zero_config.recipe.with_optimizer("muon"))
    planned = owner_comm(list(ModelSpec.from_module(net.module).shapes),
                         ParallelDims(net.mesh.dp_world, shard=net.mesh.shard_world),
                         config, rank=net.mesh.shard_rank)
    return {"measured": sum(sent.get(k, {}).get("bytes", 0) for k in planned) / steps,
            "planned": sum(planned.values())}


def paired_ratio(a: list[float], b: list[float], resamples: int = 2000,
                 seed: int = 0) -> tuple[float, float, float]:
    """Median of the per-step ratios a[k] / b[k] and its 95 % bootstrap interval."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need equally many steps of each, got {len(a)} and {len(b)}")
    ratios = [x / y for x, y in zip(a, b)]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                     for _ in range(resamples))
    return (statistics.median(ratios), medians[int(0.025 * resamples)],
            medians[int(0.975 * resamples) - 1])


def _parse_pairs(text: str, optimizer: str = "adamw") -> list[tuple[str, str]]:
    """``A:B`` pairs, each member ``IMPL`` or ``IMPL@OPTIMIZER``, as ``IMPL@OPTIMIZER``."""
    pairs = []
    for item in text.split(","):
        parts = [m if "@" in m else f"{m}@{optimizer}" for m in item.split(":")]
        impls = {m.split("@")[0] for m in parts}
        opts = {m.split("@", 1)[1] for m in parts}
        if len(parts) != 2 or not impls <= PAIRABLE or not opts <= set(OPTIMIZERS):
            raise ValueError(f"pair {item!r} must be two implementations 'A:B' "
                             f"from {sorted(PAIRABLE)}, each optionally '@' one of "
                             f"{', '.join(OPTIMIZERS)}")
        if len({m.endswith("-tp2") for m in impls}) != 1:
            raise ValueError(f"pair {item!r}: both members or neither must be -tp2 (they "
                             "read their rows by data-parallel rank)")
        pairs.append((parts[0], parts[1]))
    return pairs


def same_function(pair: tuple[str, str]) -> bool:
    """Whether a pair's members must train the same function: one optimizer, and not a
    non-elementwise one stepped by FSDP2 (which steps each rank's local shard)."""
    (a, oa), (b, ob) = (m.split("@") for m in pair)
    return oa == ob and (oa == "adamw" or not any(i.startswith("fsdp2") for i in (a, b)))


def _name(pair: tuple[str, str]) -> list[str]:
    """A pair as printed and in the JSON: the default optimizer left unnamed."""
    return [m.removesuffix("@adamw") for m in pair]


def _run_pair(pair: tuple[str, str], a: argparse.Namespace, run: int) -> dict:
    """One run of ``pair`` in fresh processes: its result, printed as one line."""
    from zeroshard.runtime.spawn import spawn

    r = spawn(_rank, a.nproc, pair, a.preset, a.steps, a.batch, a.lr,
              a.reduce_bucket_size, timeout=1800)[0]
    ta, tb = r["times"]
    mid, lo, hi = paired_ratio(ta, tb)
    la, lb = r["loss"]
    tol = LOSS_TOL_COMPILED if any("-compile" in m for m in pair) else LOSS_TOL
    same = abs(la - lb) <= tol * max(1.0, abs(lb))
    name = _name(pair)
    sa, sb = (f"{s / 1e6:.3f}" for s in r["state"])
    prefix = f"run {run + 1}/{a.runs}  " if a.runs > 1 else ""
    print(f"{prefix}{name[0]:18} {statistics.median(ta) * 1e3:7.1f} ms  against {name[1]:22} "
          f"{statistics.median(tb) * 1e3:7.1f} ms  ratio {mid:.3f}x "
          f"(95% {lo:.3f}-{hi:.3f}, {len(ta)} steps)  state {sa} / {sb} MB  "
          f"loss {la:.6f} / {lb:.6f}"
          f"{'' if same or not same_function(pair) else '  LOSSES DIFFER'}", flush=True)
    for member, owner in zip(name, r["owner"]):
        if owner is not None:
            print(f"  {member}: owner computes sent {owner['measured']:,.0f} bytes a step "
                  f"from rank 0 (planned {owner['planned']:,})", flush=True)
    return {"pair": name, "run": run, "median_ms": [statistics.median(ta) * 1e3,
                                                    statistics.median(tb) * 1e3],
            "ratio": mid, "ci95": [lo, hi], "loss": r["loss"], "same": same,
            "steps": len(ta), "state_bytes": r["state"], "times_s": [ta, tb],
            "owner_bytes_per_step": r["owner"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", default=",".join(TARGETS),
                   help="comma-separated A:B pairs; the ratio is A's time over B's "
                        "(default: each zeroshard stage against its target anchor)")
    p.add_argument("--preset", default="medium")
    p.add_argument("--steps", type=int, default=40,
                   help=f"steps of each member; the first {WARMUP} are not timed (default 40)")
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--reduce-bucket-size", type=int, metavar="ELEMENTS",
                   help="zeroshard's reduce_bucket_size (default: the engine's for "
                        "each stage, torch DDP's 25 MiB at stage 0 and one reduction per "
                        "unit at stages 1-3)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="the optimizer of members that name none (default adamw)")
    p.add_argument("--runs", type=int, default=1,
                   help="runs of every pair, each in fresh processes, the pairs taking "
                        "turns; past one, the median of the runs' ratios is reported "
                        "with their spread (default 1)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    a = p.parse_args()
    if a.reduce_bucket_size is not None and a.reduce_bucket_size < 0:
        p.error(f"--reduce-bucket-size={a.reduce_bucket_size} must be >= 0")
    try:
        pairs = _parse_pairs(a.pairs, a.optimizer)
    except ValueError as exc:
        p.error(str(exc))
    if a.runs < 1:
        p.error(f"--runs={a.runs} must be at least 1")
    if a.steps <= WARMUP:
        p.error(f"--steps={a.steps} must exceed the {WARMUP} warm-up steps")
    results, differ = [], []
    for run in range(a.runs):  # every pair once a run, so a slow hour falls on all of them
        for pair in pairs:
            results.append(_run_pair(pair, a, run))
            if not results[-1]["same"] and same_function(pair) and pair not in differ:
                differ.append(pair)
    medians = []
    if a.runs > 1:
        print(f"median of {a.runs} runs (each run's own interval in its line above):")
        for pair in pairs:
            name = _name(pair)
            ratios = [r["ratio"] for r in results if r["pair"] == name]
            medians.append({"pair": name, "ratios": ratios, "median": statistics.median(ratios)})
            print(f"{name[0]:18} against {name[1]:22} ratio {statistics.median(ratios):.3f}x  "
                  f"(runs {', '.join(f'{x:.3f}x' for x in ratios)}; spread "
                  f"{min(ratios):.3f}-{max(ratios):.3f})", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "results": results, "medians": medians}, fh,
                      indent=1)
    if differ:
        raise SystemExit(f"the members of {', '.join(':'.join(p) for p in differ)} did not "
                         f"train the same function (losses differ by more than {LOSS_TOL:g}, "
                         f"{LOSS_TOL_COMPILED:g} compiled)")


if __name__ == "__main__":
    main()
