"""Peak host memory of `zeroshard export` against the largest parameter.

    python bench/export_memory.py [--layers 8 --hidden 1024]

Saves a sharded checkpoint of a GPT (2 ranks, stage 3), then exports it in a fresh
process and reports how much that process's peak resident set grew.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile


def _save(root: str, layers: int, hidden: int) -> int:
    import torch

    import zeroshard as zs
    from zeroshard.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab=256, block_size=128, layers=layers, heads=8, hidden=hidden)
    with torch.device("meta"):
        model = GPT(cfg)
    net = zs.shard(model, stage=3, param_init=GPT.init_module)
    zs.save(net, None, os.path.join(root, "ckpt"))
    return max(p.numel() * 4 for p in GPT(cfg).parameters()) if net.mesh.dp_rank == 0 else 0


def main() -> None:
    from zeroshard.runtime.spawn import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    a = p.parse_args()
    root = tempfile.mkdtemp()
    largest = spawn(_save, 2, root, a.layers, a.hidden, timeout=600)[0]
    size = sum(os.path.getsize(os.path.join(root, "ckpt", f))
               for f in os.listdir(os.path.join(root, "ckpt")))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    out = subprocess.run([sys.executable, "-m", "zeroshard", "export", os.path.join(root, "ckpt"),
                          os.path.join(root, "out")], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    print(f"checkpoint {size / 1e6:.1f} MB on disk, largest parameter {largest / 1e6:.1f} MB")
    print(out)


if __name__ == "__main__":
    main()
