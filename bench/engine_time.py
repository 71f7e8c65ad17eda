"""The engine's own Python time per training step, at each stage asked for.

    python bench/engine_time.py                  # GPT medium, N = 2, stages 0 and 3
    python bench/engine_time.py --preset small --stages 0,1,2,3 --steps 20

Each stage trains in fresh processes; after three warm-up steps, ``--steps`` steps run
under cProfile on every rank, and rank 0 reports the self time of the functions defined
in ``zeroshard.runtime`` and ``zeroshard.observe`` (the engine's hooks, packing, landing
and bookkeeping, not the model's forward and backward, the collectives' wire time or the
optimizer's arithmetic) against the wall time of the profiled steps.
"""

from __future__ import annotations

import argparse

ENGINE = ("zeroshard/runtime/", "zeroshard/observe/")


def _rank(stage: int, preset: str, steps: int, batch: int) -> tuple[float, float]:
    import cProfile
    import pstats
    import time

    import torch
    import torch.distributed as dist

    import zeroshard as zs
    from zeroshard.data import Corpus
    from zeroshard.models.gpt import GPT, get_preset

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, corpus = get_preset(preset), Corpus.builtin()
    torch.manual_seed(0)
    net = zs.shard(GPT(cfg), stage=stage)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    rows = slice(rank * batch // world, (rank + 1) * batch // world)

    def step(k: int) -> None:
        x, y = corpus.batch("train", 0, k, batch, cfg.block_size)
        net(x[rows], y[rows]).backward()
        opt.step()
        opt.zero_grad()

    for k in range(3):  # the first steps record the gather order and make Adam's state
        step(k)
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    for k in range(3, 3 + steps):
        step(k)
    profile.disable()
    wall = time.perf_counter() - t0
    own = sum(v[2] for (path, _, _), v in pstats.Stats(profile).stats.items()
              if any(part in path.replace("\\", "/") for part in ENGINE))
    return own / steps, wall / steps


def main() -> None:
    from zeroshard.runtime.spawn import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="medium")
    p.add_argument("--stages", default="0,3", help="comma-separated stages (default 0,3)")
    p.add_argument("--steps", type=int, default=10, help="profiled steps (default 10)")
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    stages = [int(s) for s in a.stages.split(",")]
    if any(s not in (0, 1, 2, 3) for s in stages) or a.steps < 1:
        p.error(f"--stages={a.stages!r} must list stages 0-3 and --steps={a.steps} be >= 1")
    for stage in stages:
        own, wall = spawn(_rank, a.nproc, stage, a.preset, a.steps, a.batch, timeout=900)[0]
        print(f"stage {stage}: engine {own * 1e3:.1f} ms of a {wall * 1e3:.0f} ms step "
              f"({own / wall:.1%}), GPT {a.preset}, N = {a.nproc}, under cProfile")


if __name__ == "__main__":
    main()
