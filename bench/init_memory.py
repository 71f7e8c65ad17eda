"""Peak host memory of sharding a model at stage 3: built whole, or on the meta device.

    python bench/init_memory.py [--layers 8 --hidden 1024 --nproc 2]

Each way runs in fresh processes; the figure is the growth of each rank's peak
resident set (ru_maxrss) while the model is built and sharded, beside the bytes of
the full model, one unit (a block) and this rank's weight shard (at stage 3 the only
per-parameter memory a rank holds after construction: gradient shards are made by the
first backward).
"""

from __future__ import annotations

import argparse
import resource


def _rank(layers: int, hidden: int, meta: bool) -> dict:
    import torch

    import zeroshard as zs
    from zeroshard.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab=256, block_size=128, layers=layers, heads=8, hidden=hidden)
    with torch.device("meta"):  # warm-up: imports, process groups, first-use library buffers
        warm = GPT(GPTConfig(vocab=8, block_size=4, layers=2, heads=1, hidden=4))
    zs.shard(warm, stage=3, param_init=GPT.init_module)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if meta:
        with torch.device("meta"):
            model = GPT(cfg)
        net = zs.shard(model, stage=3, param_init=GPT.init_module)
    else:
        net = zs.shard(GPT(cfg), stage=3)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    unit = sum(t.numel() * 4 for t in net.module.blocks[0].parameters())
    full = sum(t.numel() * 4 for t in GPT(cfg).parameters()) if not meta else None
    mem = net.memory()
    return {"peak": peak, "unit": unit, "shard": mem["params"], "full": full}


def main() -> None:
    import os

    from zeroshard.runtime.spawn import spawn

    # A fixed mmap threshold: glibc then returns every large freed block to the system at
    # once, so the resident peak counts live tensors rather than the allocator's hoard.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    whole = spawn(_rank, a.nproc, a.layers, a.hidden, False, timeout=600)[0]
    meta = spawn(_rank, a.nproc, a.layers, a.hidden, True, timeout=600)[0]
    mb = 1e6
    print(f"full model {whole['full'] / mb:.1f} MB, one unit {whole['unit'] / mb:.1f} MB, "
          f"rank 0's weight shard {whole['shard'] / mb:.1f} MB (N = {a.nproc})")
    print(f"peak growth, built whole then sharded: {whole['peak'] / mb:.1f} MB")
    print(f"peak growth, built on meta, one unit at a time: {meta['peak'] / mb:.1f} MB "
          f"= shard + {(meta['peak'] - meta['shard']) / meta['unit']:.2f} units")


if __name__ == "__main__":
    main()
