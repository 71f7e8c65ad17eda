"""The ``zeroshard plan`` flags checked before any work: each value on its own (positive,
finite, within what the planner plans), the flags that contradict each other, the
output files' folders, and the trainer's rules for the model planned."""

from __future__ import annotations

import math
import re

from .._paths import output_file
from ..plan.advice import MAX_GPUS, MAX_PARAMS
from ..plan.search import CHECKPOINTING
from ..spec.config import check_checkpointing
from ..spec.dims import check_tp_degree
from ..spec.formulas import QUANT_BLOCK
from ..spec.lora import check_beside_tp
from . import plan_time

#: The model's dimension flags (``--hidden`` ...), each a positive count.
DIM_FLAGS = ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab")

#: Most memory per GPU in GB that --gpu-mem takes (a thousand times today's largest).
MAX_GPU_MEM = 10**6


def _positive(name: str, value) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"--{name}={value} must be positive")


def _at_most(name: str, value, most: int, what: str) -> None:
    if value is not None and value > most:
        raise ValueError(f"--{name}={value} is more than {what}: at most {most:,}")


def checkpointing_mode(args) -> str | int:
    """The activation checkpointing the flags ask for, as ``ZeroConfig.
    activation_checkpointing`` writes it: ``--activation-checkpointing``, or the older
    ``--no-checkpointing`` and ``--checkpoint-every K``; "full" when none is given."""
    older = "none" if args.no_checkpointing else (args.checkpoint_every or None)
    if args.activation_checkpointing is None:
        return check_checkpointing(older or "full")
    try:
        mode = check_checkpointing(args.activation_checkpointing)
    except ValueError as exc:
        raise ValueError(str(exc).replace("activation_checkpointing=",
                                          "--activation-checkpointing=", 1)) from None
    if older is not None and check_checkpointing(older) != mode:
        flag = "--no-checkpointing" if args.no_checkpointing else \
            f"--checkpoint-every {args.checkpoint_every}"
        raise ValueError(f"--activation-checkpointing {args.activation_checkpointing} and "
                         f"{flag} contradict each other: give one")
    return mode


def asked_checkpointing(args) -> str | None:
    """The checkpointing ``--recommend`` keeps fixed: the one the flags name (None when
    none does: it weighs none, selective and full)."""
    if args.activation_checkpointing is None and not args.no_checkpointing and \
            args.checkpoint_every is None:
        return None
    mode = checkpointing_mode(args)
    if mode not in CHECKPOINTING:
        raise ValueError(f"--recommend weighs activation checkpointing "
                         f"{', '.join(CHECKPOINTING)}; {mode!r} is plan's alone: drop it "
                         "to have them weighed, or name one of them")
    return mode


def check_flags(args) -> None:
    """Flag values that are wrong whatever else is asked, found before any work."""
    for name in ("gpus", "gpu_mem", "tokens", "seq_len", "params", "checkpoint_every",
                 "gpu_step", *DIM_FLAGS):
        _positive(name.replace("_", "-"), getattr(args, name))
    if not math.isfinite(args.gpu_mem):
        raise ValueError(f"--gpu-mem={args.gpu_mem} must be a finite number of GB per GPU")
    _at_most("gpu-mem", args.gpu_mem, MAX_GPU_MEM, "any accelerator holds (GB per GPU)")
    for name in ("gpus", "gpu_step", "gpus_per_node"):
        _at_most(name.replace("_", "-"), getattr(args, name), MAX_GPUS, "the planner plans")
    _at_most("params", args.params, MAX_PARAMS, "the planner plans (500 times the largest "
             "published models)")
    if args.checkpoint_every is not None and args.no_checkpointing:
        raise ValueError("--checkpoint-every and --no-checkpointing contradict each other")
    checkpointing_mode(args)
    plan_time.check(args)
    if args.offload_dir and not (args.offload or args.recommend):
        raise ValueError("--offload-dir keeps the offloaded optimizer state on disk: add "
                         "--offload optimizer (or params), or --recommend (which offloads "
                         "only when nothing fits)")
    if args.sub_group_size is not None and not args.offload_dir:
        raise ValueError(f"--sub-group-size={args.sub_group_size} sizes disk offload's "
                         "step: add --offload-dir")
    _positive("sub-group-size", args.sub_group_size)
    if args.gpu_step is not None and not args.min_gpus:
        raise ValueError("--gpu-step only applies with --min-gpus")
    zeropp = args.hpz is not None or args.quantize_weights or args.quantize_grads
    if not zeropp and args.quant_block != QUANT_BLOCK:
        raise ValueError(f"--quant-block={args.quant_block} needs --quantize-weights or "
                         "--quantize-grads")
    for flag in ("html", "plot"):  # an output file's folder must exist and take writes
        if getattr(args, flag) is not None:
            output_file(f"--{flag}", getattr(args, flag))


def sweep_counts(spec: str | None) -> list[int] | None:
    """``--sweep``'s GPU counts (None when not given)."""
    if spec is None:
        return None
    try:
        counts = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"--sweep={spec!r} must be comma-separated GPU counts, e.g. 8,16,32") from None
    if not counts or any(n <= 0 for n in counts):
        raise ValueError(f"--sweep={spec!r} must list positive GPU counts, e.g. 8,16,32")
    _at_most("sweep", max(counts), MAX_GPUS, "the planner plans")
    return counts


def model_rules(args, model) -> None:
    """What ``zeroshard train`` refuses for this model, refused here too, by the same rules
    (``spec/``): a tensor-parallel degree that does not divide what it splits, LoRA
    beside tensor parallelism. The spec names settings; here they are flags."""
    tp = args.tp or 1
    try:
        if tp > 1 and model.arch is not None:
            check_tp_degree(tp, model.name, model.arch.tp_sizes())
        check_beside_tp(args.lora, tp)
    except ValueError as exc:
        raise ValueError(re.sub(r"\b(lora|tp)=", r"--\1=", str(exc))) from None
