"""zeroshard import-deepspeed — a DeepSpeed ZeRO checkpoint as a zeroshard checkpoint.

Reads a DeepSpeed stage 1, 2 or 3 checkpoint (DIR with its `latest` file, or DIR/TAG)
— the fp32 master weights, the optimizer state (Adam's moments and step), the param
groups' settings and the buffers — and writes OUT, which `zs.load(model, optimizer,
OUT)` loads at any number of ranks and any stage. The rank files are read a slice at a
time: host memory stays near the largest parameter whatever the model's size
(DeepSpeed's zero_to_fp32 holds the whole model). DeepSpeed need not be installed, and
nothing in its files is run. OUT appears complete or not at all.

example:
  zeroshard import-deepspeed runs/ds_ckpt runs/zs_ckpt
  zeroshard import-deepspeed runs/ds_ckpt runs/zs_ckpt --tag global_step1200 --world 8
"""

from __future__ import annotations

import argparse
import resource

#: Most rank files --world writes (the most ranks zeroshard plans for).
MOST_RANK_FILES = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="a DeepSpeed save folder (with `latest`) or one tag folder "
                               "in it (global_stepN)")
    p.add_argument("out", help="the zeroshard checkpoint folder to write (new, or empty)")
    p.add_argument("--tag", help="the tag folder to read (default: the one `latest` names)")
    p.add_argument("--world", type=int, metavar="N",
                   help="rank files to write (default: the DeepSpeed run's N); any N and "
                        "stage loads the result")


def run(args) -> int:
    from ..checkpoint.deepspeed import import_deepspeed

    if args.world is not None and args.world < 1:
        raise ValueError(f"--world={args.world}: expected a number of rank files >= 1")
    if args.world is not None and args.world > MOST_RANK_FILES:
        raise ValueError(f"--world={args.world}: at most {MOST_RANK_FILES:,} rank files")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    m = import_deepspeed(args.dir, args.out, tag=args.tag, world=args.world)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    ds = m["extra"]["deepspeed"]
    numel = sum(_numel(p["shape"]) for p in m["params"].values())
    print(f"imported {ds['folder']} (DeepSpeed {ds['version']}, ZeRO stage {ds['stage']}, "
          f"N = {ds['world']}, step {m['extra']['step']}): {numel:,} parameters in "
          f"{len(m['params'])} tensors, optimizer state for {len(m['optimizer']['param_groups'])}"
          f" param group(s), into {len(m['files'])} file(s) in {args.out}; peak host memory "
          f"grew by {grown / 1e6:.1f} MB")
    return 0


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
