"""zeroshard train's flags for fine-tuning with adapters and for compiling:

  zeroshard train --hf-model ./my-llama --data notes/ --lora 16 --stage 3
  zeroshard export runs/ckpt ./adapter            # peft's adapter files
  zeroshard export runs/ckpt ./merged --merge     # the model with the adapters merged
"""

from __future__ import annotations

import argparse

from ..spec.lora import DEFAULT_ALPHA, DEFAULT_DROPOUT


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fine-tuning with adapters (peft's LoRA), and compilation")
    g.add_argument("--lora", type=int, metavar="R",
                   help="train LoRA adapters of rank R on the frozen model (needs peft); the "
                        "base keeps its weights, sharded as any at stage 3")
    g.add_argument("--lora-alpha", type=float, metavar="A",
                   help=f"the adapters' output is scaled by A / R (default {DEFAULT_ALPHA:g})")
    g.add_argument("--lora-dropout", type=float, metavar="P",
                   help=f"dropout on the adapters' input (default {DEFAULT_DROPOUT:g})")
    g.add_argument("--lora-targets", metavar="NAMES",
                   help="comma-separated module names to adapt (default: peft's for the "
                        "family: q_proj,v_proj for Llama, Mistral and Qwen2, c_attn for GPT-2; "
                        "qkv for the built-in GPT)")
    g.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                   help="torch.compile each unit's forward, the engine's hooks eager around "
                        "it (default backend when given: inductor)")
