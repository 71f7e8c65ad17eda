"""zeroshard verify — before a long run, proof that your configuration computes what the
unsharded model computes: the run ``zeroshard train`` would make of the same flags,
its first K steps (--verify-steps, default 5) sharded on --nproc local processes and
unsharded in this one, on the same global batches, every tensor compared:

  zeroshard verify --hf-model ./my-llama --data ./notes/ --stage 3 --mixed-precision bf16 \\
                   --optimizer muon --layers 2      # the same flags as your train command

Per category (initial weights, losses, the gradients of step 1, the weights, each
optimizer state) the largest difference, the tensor it is in, and a verdict: bitwise,
within rounding (the bound printed: docs/verify.md says how it is derived), or DIFFERS
(exit code 1). The run's memory by category and its traffic per step are printed
beside the planner's. Flags that only a long run reads (--save-dir, --tensorboard,
--resume, --profile, ...) are accepted and not used: verify writes nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from ..train import flags
from . import train as train_command

#: The trainer's flags that a run of a few steps in memory does not read.
_RUN_ONLY = ("save_dir", "save_every", "keep_last", "resume", "tensorboard", "json_log",
             "profile", "eval_every", "sample_chars")


def add_arguments(p: argparse.ArgumentParser) -> None:
    train_command.add_arguments(p)
    g = p.add_argument_group("verify")
    g.add_argument("--verify-steps", type=int, default=5, metavar="K",
                   help="steps compared: the run's first K (default 5; --steps still sets "
                        "the learning-rate schedule they follow)")
    g.add_argument("--layers", type=int, metavar="L",
                   help="check a model of L transformer blocks of the same architecture "
                        "(the first L of --hf-model's weights)")
    g.add_argument("--hidden", type=int, metavar="H",
                   help="check a model of width H of the same architecture (seeded "
                        "random weights)")
    g.add_argument("--json", metavar="FILE", help="also write the certificate as JSON")


def _checked(args, cfg) -> list[str]:
    """What verify refuses, and notes on what it leaves out."""
    for name in ("verify_steps", "layers", "hidden"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value}; expected a positive "
                             "integer")
    if cfg.init_from:
        raise ValueError(f"init_from={cfg.init_from!r}: verify builds the model from --model "
                         "or --hf-model (any initial weights check the same arithmetic); "
                         "drop --init-from here")
    if cfg.compile:
        raise ValueError(f"compile={cfg.compile!r}: a compiled forward fuses operations in "
                         "its own order, so it is checked against the eager run by the test "
                         "suite (tests/engine/test_compile.py), not by verify: drop --compile")
    given = [f"--{k.replace('_', '-')}" for k in _RUN_ONLY if getattr(args, k, None)]
    notes = [f"{', '.join(given)}: not read by verify, which writes nothing"] if given else []
    micro, accum = cfg.accumulation(cfg.nproc)
    if accum > 1:
        notes.append(f"each rank's {micro * accum} rows of a step run as one micro-batch "
                     f"here (the run accumulates {accum}): the sum over micro-batches is "
                     "the trainer's, the sharding is what is checked")
    return notes


def run(args) -> int:
    from ..parity.certify import certify
    from ..parity.fromtrain import (
        Shrink,
        TrainLoss,
        TrainModel,
        TrainOptimizer,
        TrainSchedule,
        TrainTPPlan,
        train_batches,
    )
    from ..parity.trial import Trial
    from ..train.hfmodel import model_source

    with flags.named(args):
        cfg = train_command.config_of(args)
        notes = _checked(args, cfg)
        source = model_source(cfg)
        if cfg.tp > 1:  # the sizes it splits, before any rank starts
            from ..spec.dims import check_tp_degree

            check_tp_degree(cfg.tp, source.label, source.tp_sizes())
        shrink = Shrink(args.layers, args.hidden)
        batches = train_batches(cfg, args.verify_steps, source.vocab, source.seq_len)
        trial = Trial(TrainModel(cfg, shrink), TrainOptimizer(cfg), batches, cfg.zero,
                      cfg.nproc, TrainLoss(cfg), cfg.clip, TrainSchedule(cfg), cfg.seed,
                      cfg.timeout * 2, tp=cfg.tp,
                      tp_plan=TrainTPPlan(cfg) if cfg.tp > 1 else None)
    label = source.label + (f" ({', '.join(_shrunk(shrink))})" if _shrunk(shrink) else "")
    console = Console()
    console.print(f"verify: {label}, {args.verify_steps} steps of {cfg.batch} sequences "
                  f"on {cfg.nproc} processes and in this one ...")
    cert = certify(trial, notes=notes)
    cert.title = f"{label}, {cert.title}"
    cert.print(console)
    if args.json:
        Path(args.json).write_text(json.dumps(cert.to_dict(), indent=1), encoding="utf-8")
    return 0 if cert.ok else 1


def _shrunk(shrink) -> list[str]:
    return [f"{k} {v}" for k, v in (("layers", shrink.layers), ("hidden", shrink.hidden))
            if v is not None]
