"""LoRA as the trainer builds it and the planner counts it (torch-free).

LoRA (Hu et al., 2021) freezes the model and adds to a linear layer W (``in`` → ``out``)
the product B·A of two trainable matrices, A ``[r, in]`` and B ``[out, r]``, scaled by
alpha / r: ``r·(in + out)`` trainable parameters per adapted layer instead of
``in·out``. The engine trains them like any parameters: the frozen base still takes
its compute weights (sharded at stage 3), while gradients, the master and the
optimizer state exist for the adapters alone.

Which layers are adapted is a list of module names, matched as peft matches them (the
last part of a module's name). Each name stands for one or more projections of a
block, and the names are a model's own: a Llama's ``q_proj`` is no GPT-2 layer
(:data:`MODULES`, by the naming an architecture carries). peft's defaults by model
family (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`` in
``peft/utils/constants.py``: q_proj and v_proj for Llama, Mistral, Qwen2/3 and Gemma-2,
c_attn for GPT-2, query_key_value for GPT-NeoX) are :data:`DEFAULT_ROLES`.

The rank must fit the layers it adapts: ``B·A`` has rank at most ``min(in, out)``, so a
larger r only adds parameters (``r·(in + out)`` of them, more than the layer itself
once r passes ``in·out / (in + out)``); :meth:`LoraSpec.check_widths` refuses it, for
the trainer (the model's layers) and the planner (the architecture's projections) alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Per naming, the module names of a block's projections and the projections each holds:
#: Llama's separate q/k/v/o and gated MLP (Mistral, Qwen2/3 and Gemma-2 name them alike),
#: GPT-2's fused c_attn and its two c_proj (attention output and MLP output share the
#: name), GPT-NeoX's, and the built-in GPT's (``models/gpt.py``).
MODULES: dict[str, dict[str, tuple[str, ...]]] = {
    "llama": {"q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",),
              "gate_proj": ("gate",), "up_proj": ("up",), "down_proj": ("down",)},
    "gpt2": {"c_attn": ("qkv",), "c_proj": ("o", "down"), "c_fc": ("up",)},
    "neox": {"query_key_value": ("qkv",), "dense": ("o",), "dense_h_to_4h": ("up",),
             "dense_4h_to_h": ("down",)},
    "zeroshard": {"q": ("q",), "k": ("k",), "v": ("v",), "proj": ("o",), "fc": ("up",),
                  "out": ("down",)},
}

#: What LoRA adapts by default, by naming (peft's defaults; the built-in GPT's as Llama's).
DEFAULT_ROLES: dict[str, tuple[str, ...]] = {
    "llama": ("q", "v"), "gpt2": ("qkv",), "neox": ("qkv",), "zeroshard": ("q", "v"),
}

#: The built-in GPT's module names for the default projections (its separate ``q`` and
#: ``v``, as peft's default for Llama's ``q_proj`` and ``v_proj``).
BUILTIN_TARGETS = ("q", "v")

#: peft's ``LoraConfig`` defaults for the scale's numerator and the dropout.
DEFAULT_ALPHA = 8.0
DEFAULT_DROPOUT = 0.0


def check_beside_tp(rank: int | None, tp: int) -> None:
    """LoRA and tensor parallelism are not combined: peft's adapters wrap the very layers
    tensor parallelism splits, and the adapters' own weights have no tp plan."""
    if rank is not None and tp > 1:
        raise ValueError(f"lora={rank} with tp={tp}: peft's adapters wrap the layers tensor "
                         "parallelism splits, and their own weights have no tp plan; give "
                         "one of them")


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters on a frozen model; validated at construction."""

    rank: int
    """r: the inner width of each adapter."""
    alpha: float = DEFAULT_ALPHA
    """The adapters' output is scaled by alpha / r (peft's ``lora_alpha``)."""
    dropout: float = DEFAULT_DROPOUT
    """Dropout on each adapter's input (peft's ``lora_dropout``)."""
    targets: tuple[str, ...] | None = None
    """Module names to adapt; None: the naming's default (:data:`DEFAULT_ROLES`)."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"lora={self.rank!r} must be a positive integer (the adapters' "
                             "rank)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) \
                or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"lora_alpha={self.alpha!r} must be a finite positive number")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0 <= self.dropout < 1:  # (nan compares False: refused too)
            raise ValueError(f"lora_dropout={self.dropout!r} must be in [0, 1)")
        if self.targets is not None:
            if isinstance(self.targets, str):
                object.__setattr__(self, "targets", tuple(
                    t.strip() for t in self.targets.split(",") if t.strip()))
            if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
                raise ValueError(f"lora_targets={self.targets!r}; expected module names such "
                                 "as q_proj,v_proj")

    def roles(self, naming: str) -> tuple[str, ...]:
        """The projections adapted in a block of a model whose modules are named as
        ``naming`` says (:data:`MODULES`), each once."""
        if naming not in MODULES:
            raise ValueError(f"no LoRA targets are known for naming {naming!r}; expected one "
                             f"of {', '.join(MODULES)}")
        if self.targets is None:
            return DEFAULT_ROLES[naming]
        names = MODULES[naming]
        unknown = [t for t in self.targets if t not in names]
        if unknown:
            raise ValueError(f"lora_targets: {unknown[0]!r} names no layer of this model; "
                             f"its blocks' layers are {', '.join(names)}")
        return tuple(dict.fromkeys(r for t in self.targets for r in names[t]))

    def layer_of(self, naming: str, role: str) -> str:
        """The name a ``naming`` model gives the layer holding projection ``role``."""
        return next(n for n, roles in MODULES[naming].items() if role in roles)

    def check_widths(self, widths: dict[str, tuple[int, int]]) -> None:
        """The rank fits every adapted layer (``widths``: name -> (in, out) features):
        ``r <= min(in, out)``, beyond which ``B·A`` gains no rank, only parameters."""
        if not widths:
            return
        name, (n_in, n_out) = min(widths.items(), key=lambda item: min(item[1]))
        if self.rank > min(n_in, n_out):
            raise ValueError(f"lora={self.rank} is above the width of the adapted layer "
                             f"{name} ({n_in} -> {n_out} features): an update B·A has rank "
                             f"at most {min(n_in, n_out)}, so a larger rank adds parameters "
                             f"and nothing else; give 1 to {min(n_in, n_out)}")
