"""The plan command's LoRA flags: ``--lora R`` plans fine-tuning with adapters on a
frozen base (``plan/adaptercount.py``): the adapters' parameters train, with their gradients and
optimizer state; the base is weights only, at the weights' dtype."""

from __future__ import annotations

import argparse
import re

from ..plan.adaptercount import with_lora
from ..plan.arch import ModelSpec
from ..spec.lora import DEFAULT_ROLES, LoraSpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA (adapters trained on a frozen base)")
    g.add_argument("--lora", type=int, metavar="R",
                   help="plan LoRA fine-tuning of rank R: gradients and optimizer state for "
                        "the adapters only, the frozen base at the weights' dtype")
    defaults = "; ".join(f"{f}: {','.join(r)}" for f, r in DEFAULT_ROLES.items())
    g.add_argument("--lora-targets", metavar="NAMES",
                   help="comma-separated module names to adapt, e.g. q_proj,k_proj,v_proj,"
                        f"o_proj (default: peft's by family, as projections: {defaults})")


def apply(args, model: ModelSpec) -> ModelSpec:
    """``model`` with the adapters ``--lora`` asks for (unchanged without it); what the
    plan cannot yet weigh with adapters is refused here, in one line."""
    if args.lora is None:
        if args.lora_targets:
            raise ValueError(f"--lora-targets={args.lora_targets} needs --lora R")
        return model
    if args.lora <= 0:
        raise ValueError(f"--lora={args.lora} must be a positive rank")
    for flag in ("time", "recommend", "html", "hpz", "quantize_weights", "quantize_grads",
                 "offload"):
        if getattr(args, flag, None):
            raise ValueError(f"--lora plans memory and bytes on the wire per strategy; "
                             f"--{flag.replace('_', '-')} does not weigh adapters yet: drop "
                             "one of them")
    try:
        return with_lora(model, LoraSpec(args.lora, targets=args.lora_targets))
    except ValueError as exc:  # the spec names the settings; here they are flags
        raise ValueError(re.sub(r"\blora(_targets)?(?=[=:])",
                                lambda m: "--" + m.group(0).replace("_", "-"), str(exc))) \
            from None
