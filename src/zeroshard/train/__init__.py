"""zeroshard train — the built-in GPT on the built-in corpus, sharded over N processes.

Launches --nproc local processes through PyTorch's own launcher (torch.distributed.run).
Under torchrun the same command runs as one rank of a larger job, e.g. on two 8-GPU
nodes:

  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
           --rdzv-endpoint HOST:29500 -m zeroshard train --stage 3 --precision bf16

Flags override --config, which overrides the defaults. --config takes a JSON file of
this command's settings (the flag names with underscores) or a DeepSpeed config, whose
zero_optimization.stage, bf16.enabled, gradient_clipping, gradient_accumulation_steps,
train_micro_batch_size_per_gpu, train_batch_size, reduce_bucket_size,
stage3_prefetch_bucket_size and stage3_param_persistence_threshold are honoured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from dataclasses import asdict, replace

from .config import TrainConfig, resolve


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--nproc", type=int, help=f"local processes (default {d.nproc})")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3),
                   help=f"ZeRO stage (default {d.stage})")
    p.add_argument("--precision", choices=("fp32", "bf16"), help="default fp32")
    p.add_argument("--units", help="unit policy: blocks, model, or a parameter count "
                                   "(default blocks)")
    p.add_argument("--model", help="GPT preset: tiny, small (0.84M, default) or medium (10.8M)")
    p.add_argument("--steps", type=int, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--batch", type=int, help=f"global batch in sequences (default {d.batch})")
    p.add_argument("--micro-batch", type=int,
                   help="sequences per process per forward; accumulation follows "
                        "(default: batch / N)")
    p.add_argument("--lr", type=float, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--warmup", type=int, help="warm-up steps (default 10%% of --steps)")
    p.add_argument("--clip", type=float, help=f"gradient-norm clip, 0 for none (default {d.clip})")
    p.add_argument("--seed", type=int, help=f"seed (default {d.seed})")
    p.add_argument("--eval-every", type=int, help=f"steps between evaluations "
                                                  f"(default {d.eval_every})")
    p.add_argument("--sample-chars", type=int, help=f"bytes to sample at the end "
                                                    f"(default {d.sample_chars})")
    p.add_argument("--json-log", metavar="FILE", help="one JSON object per step")
    p.add_argument("--save-dir", metavar="DIR", help="write sharded checkpoints here")
    p.add_argument("--save-every", type=int, help="checkpoint every this many steps "
                                                  "(default: only at the end)")
    p.add_argument("--resume", metavar="CKPT", help="a checkpoint path, or 'latest' in "
                                                    "--save-dir; any --nproc and --stage")
    p.add_argument("--init-from", metavar="PATH", help="initial weights from consolidated "
                                                       "safetensors")
    p.add_argument("--profile", metavar="DIR", help="profile two steps: trace, lifetime chart, "
                                                    "peak and plan against measurement")
    p.add_argument("--config", metavar="FILE", help="JSON settings or a DeepSpeed config")


def _config(args) -> TrainConfig:
    flags = {k: getattr(args, k) for k in vars(args) if not k.startswith("_")}
    cfg = resolve({**flags, "clip": flags["clip"] or None}, args.config)
    return replace(cfg, clip=None) if flags["clip"] == 0 else cfg


#: The launcher hands the resolved settings to its ranks here (not as arguments, which
#: torch.distributed.run would try to parse as its own).
_ENV = "ZEROSHARD_TRAIN_CONFIG"


def run(args) -> int:
    if _ENV in os.environ:  # a rank started by the launcher below
        cfg = TrainConfig(**json.loads(os.environ[_ENV]))
    else:
        cfg = _config(args)  # validate before launching anything
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from ..runtime.dist import release_process_groups
        from .loop import train

        try:
            train(cfg)
        except BaseException as exc:
            # the traceback holds train's frames, and with them the model
            traceback.clear_frames(exc.__traceback__)
            release_process_groups()
            raise
        release_process_groups()
        return 0
    cfg.accumulation(cfg.nproc)  # the batch must divide over the processes
    _check_paths(cfg)
    env = dict(os.environ)
    env[_ENV] = json.dumps(asdict(cfg))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(cfg.nproc), "-m", "zeroshard", "train"]
    return subprocess.run(cmd, env=env).returncode


def _check_paths(cfg: TrainConfig) -> None:
    """Name a checkpoint or weights path that cannot be read, before any process starts."""
    from pathlib import Path

    from ..checkpoint.sharded import resolve

    if cfg.resume:
        resolve(Path(cfg.save_dir) if cfg.resume == "latest" else cfg.resume)
    if cfg.init_from and not Path(cfg.init_from).exists():
        raise ValueError(f"init_from={cfg.init_from!r}: no such file or directory")
