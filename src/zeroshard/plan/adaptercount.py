"""LoRA in the plan: the adapters' parameters, and the model they make.

A block's projection from ``in`` to ``out`` features gets ``r·(in + out)`` adapter
parameters (``spec/lora.py``); the projections' widths come from the architecture
(``arch.py``): the query ``h → q``, each of key and value ``h → kv`` (fused: ``h → q +
2·kv``), the attention output ``q → h``, the MLP's gate and up ``h → f`` and its down
``f → h``. The plan is then the base model and the adapters together: every parameter
counts in the weights (the frozen base at the weights' dtype, sharded as any weight),
the adapters alone in the gradients and the optimizer state, and on the wire the
gradients reduced and the weights gathered after the step are the adapters' alone
(stage 3 still gathers every weight for forward and backward).
"""

from __future__ import annotations

from dataclasses import replace

from ..spec.lora import LoraSpec
from .arch import Architecture, ModelSpec


def projection(arch: Architecture, role: str) -> tuple[int, int]:
    """(in, out) features of one projection of a block of ``arch``."""
    h, f, q, kv = arch.hidden, arch.ffn, arch.q_width, arch.kv_width
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "qkv": (h, q + 2 * kv), "o": (q, h),
            "gate": (h, f), "up": (h, f), "down": (f, h)}[role]


def adapter_params(arch: Architecture, lora: LoraSpec) -> int:
    """Parameters of every adapter ``lora`` adds to ``arch``'s blocks. A layer the model
    does not have (GPT-2's c_attn in a Llama, a gate in GPT-2's plain MLP), or a rank
    above a layer's width, is an error."""
    roles = lora.roles(arch.naming)
    if "gate" in roles and not arch.gated_mlp:
        raise ValueError(f"{arch.name}: its MLP has no gate projection to adapt (a plain "
                         "MLP: up and down only)")
    lora.check_widths({lora.layer_of(arch.naming, r): projection(arch, r) for r in roles})
    per_block = sum(lora.rank * sum(projection(arch, r)) for r in roles)
    return arch.layers * per_block


def with_lora(model: ModelSpec, lora: LoraSpec) -> ModelSpec:
    """``model`` with ``lora``'s adapters: every parameter in ``params``, the adapters in
    ``trainable``. The architecture's dimensions must be known."""
    if model.arch is None:
        raise ValueError(f"{model.name}: LoRA's adapters are counted from the model's "
                         "projections; give an architecture (--model, --hf-config or its "
                         "dimensions), not a bare --params count")
    adapters = adapter_params(model.arch, lora)
    return replace(model, name=f"{model.name} + LoRA r={lora.rank}",
                   params=model.params + adapters, trainable=adapters)
