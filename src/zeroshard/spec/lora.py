"""LoRA as the trainer builds it and the planner counts it (torch-free).

LoRA (Hu et al., 2021) freezes the model and adds to a linear layer W (``in`` → ``out``)
the product B·A of two trainable matrices, A ``[r, in]`` and B ``[out, r]``, scaled by
alpha / r: ``r·(in + out)`` trainable parameters per adapted layer instead of
``in·out``. The engine trains them like any parameters: the frozen base still takes
its compute weights (sharded at stage 3), while gradients, the master and the
optimizer state exist for the adapters alone.

Which layers are adapted is a list of module names, matched as peft matches them (the
last part of a module's name). Each name stands for one or more projections of a
block (:data:`ROLES`); peft's defaults by model family
(``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`` in
``peft/utils/constants.py``: q_proj and v_proj for Llama, Mistral, Qwen2/3 and Gemma-2,
c_attn for GPT-2, query_key_value for GPT-NeoX) are :data:`DEFAULT_ROLES`.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The projections of a block, by the module names that hold them in each family:
#: Llama's separate q/k/v/o and gated MLP, GPT-2's fused c_attn and its two c_proj
#: (attention output and MLP output share the name), GPT-NeoX's, and the built-in GPT's.
ROLES: dict[str, tuple[str, ...]] = {
    "q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",),
    "gate_proj": ("gate",), "up_proj": ("up",), "down_proj": ("down",),
    "c_attn": ("qkv",), "c_proj": ("o", "down"), "c_fc": ("up",),
    "query_key_value": ("qkv",), "dense": ("o",), "dense_h_to_4h": ("up",),
    "dense_4h_to_h": ("down",),
    "qkv": ("qkv",), "q": ("q",), "k": ("k",), "v": ("v",), "proj": ("o",), "fc": ("up",),
    "out": ("down",),
}

#: What LoRA adapts by default, by the planner's architecture family (peft's defaults).
DEFAULT_ROLES: dict[str, tuple[str, ...]] = {
    "llama": ("q", "v"), "gemma2": ("q", "v"), "gpt": ("qkv",), "neox": ("qkv",),
}

#: The built-in GPT's module names for the default projections (its separate ``q`` and
#: ``v``, as peft's default for Llama's ``q_proj`` and ``v_proj``).
BUILTIN_TARGETS = ("q", "v")

#: peft's ``LoraConfig`` defaults for the scale's numerator and the dropout.
DEFAULT_ALPHA = 8.0
DEFAULT_DROPOUT = 0.0


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
    """Module names to adapt; None: the family's default (:data:`DEFAULT_ROLES`)."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"lora rank={self.rank!r} must be a positive integer")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) \
                or self.alpha <= 0:
            raise ValueError(f"lora_alpha={self.alpha!r} must be a positive number")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0 <= self.dropout < 1:
            raise ValueError(f"lora_dropout={self.dropout!r} must be in [0, 1)")
        if self.targets is not None:
            if isinstance(self.targets, str):
                object.__setattr__(self, "targets", tuple(
                    t.strip() for t in self.targets.split(",") if t.strip()))
            if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
                raise ValueError(f"lora targets={self.targets!r}; expected module names such "
                                 "as q_proj,v_proj")

    def roles(self, family: str) -> tuple[str, ...]:
        """The projections adapted in a block of ``family``, each once."""
        if self.targets is None:
            if family not in DEFAULT_ROLES:
                raise ValueError(f"no default LoRA targets for family {family!r}; name the "
                                 "modules (e.g. q_proj,v_proj)")
            return DEFAULT_ROLES[family]
        unknown = [t for t in self.targets if t not in ROLES]
        if unknown:
            raise ValueError(f"lora target {unknown[0]!r} is not a projection the planner "
                             f"knows; expected some of {', '.join(ROLES)}")
        return tuple(dict.fromkeys(r for t in self.targets for r in ROLES[t]))
