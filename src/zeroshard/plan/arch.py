"""Architectures: parameter counts from transformer dimensions, presets, HF configs.

A decoder-only transformer of hidden size h, L layers, vocabulary V holds

- embeddings ``V·h`` (plus ``max_positions·h`` for learned positions), and a separate
  ``V·h`` head unless it is tied to the embedding;
- per layer: attention ``2·h·h + 2·h·(kv_heads·head_dim)`` (q, o and the k, v
  projections, smaller under grouped-query attention), an MLP of ``3·h·f`` (gated:
  gate, up, down) or ``2·h·f`` (plain), two norms, and biases where the family has them;
- a final norm.

The counts are checked against the published ones (Llama-2 7B = 6,738,415,616;
GPT-2 small = 124,439,808, ...) in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .._jsonfile import read_json_object


@dataclass(frozen=True)
class Architecture:
    """Dimensions of a decoder-only transformer; validated at construction."""

    name: str
    """Label shown in tables."""
    hidden: int
    """Model width h."""
    layers: int
    """Number of transformer blocks L."""
    heads: int
    """Attention heads a (the activation model needs it)."""
    ffn: int
    """MLP inner width f."""
    vocab: int
    """Vocabulary size V."""
    kv_heads: int | None = None
    """Key/value heads under grouped-query attention; None means ``heads``."""
    head_dim: int | None = None
    """Per-head width; None means ``hidden // heads``."""
    tied: bool = False
    """The output head shares the token-embedding matrix."""
    max_positions: int = 0
    """Rows of a learned position embedding (GPT-2); 0 for rotary models."""
    gated_mlp: bool = True
    """Three MLP matrices (SwiGLU: gate, up, down) instead of two."""
    norm_bias: bool = False
    """Norms carry a bias (LayerNorm) rather than a weight only (RMSNorm)."""
    linear_bias: bool = False
    """Every attention and MLP projection carries a bias (GPT-2, GPT-NeoX)."""

    def __post_init__(self) -> None:
        for field in ("hidden", "layers", "heads", "ffn", "vocab"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{self.name}: {field}={value!r} must be a positive integer")
        for field in ("kv_heads", "head_dim"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{self.name}: {field}={value!r} must be a positive integer")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(
                f"{self.name}: hidden={self.hidden} is not divisible by heads={self.heads}; "
                "give head_dim explicitly"
            )
        if self.max_positions < 0:
            raise ValueError(f"{self.name}: max_positions={self.max_positions} must be >= 0")

    @property
    def params(self) -> int:
        """Total parameter count, norms and biases included."""
        h, f = self.hidden, self.ffn
        head_dim = self.head_dim or h // self.heads
        q_width = self.heads * head_dim
        kv_width = (self.kv_heads or self.heads) * head_dim
        attn = h * q_width + 2 * h * kv_width + q_width * h
        mlp = (3 if self.gated_mlp else 2) * h * f
        norm = h * (2 if self.norm_bias else 1)
        per_layer = attn + mlp + 2 * norm
        if self.linear_bias:
            per_layer += q_width + 2 * kv_width + h  # q, k, v and output-projection biases
            per_layer += (2 if self.gated_mlp else 1) * f + h  # MLP biases
        embed = self.vocab * h + self.max_positions * h
        head = 0 if self.tied else self.vocab * h
        return embed + self.layers * per_layer + norm + head


def _llama(name, hidden, layers, heads, ffn, vocab=32000, kv_heads=None, tied=False):
    return Architecture(name, hidden, layers, heads, ffn, vocab, kv_heads=kv_heads, tied=tied)


def _gpt2(name, hidden, layers, heads):
    return Architecture(
        name, hidden, layers, heads, 4 * hidden, 50257, tied=True, max_positions=1024,
        gated_mlp=False, norm_bias=True, linear_bias=True,
    )


PRESETS: dict[str, Architecture] = {
    a.name: a
    for a in (
        _llama("llama2-7b", 4096, 32, 32, 11008),
        _llama("llama2-13b", 5120, 40, 40, 13824),
        _llama("llama2-70b", 8192, 80, 64, 28672, kv_heads=8),
        _llama("llama3-8b", 4096, 32, 32, 14336, vocab=128256, kv_heads=8),
        _llama("llama3-70b", 8192, 80, 64, 28672, vocab=128256, kv_heads=8),
        _llama("mistral-7b", 4096, 32, 32, 14336, kv_heads=8),
        _gpt2("gpt2", 768, 12, 12),
        _gpt2("gpt2-medium", 1024, 24, 16),
        _gpt2("gpt2-large", 1280, 36, 20),
        _gpt2("gpt2-xl", 1600, 48, 25),
        Architecture(
            "pythia-160m", 768, 12, 12, 3072, 50304, gated_mlp=False, norm_bias=True,
            linear_bias=True,
        ),
    )
}


def get_preset(name: str) -> Architecture:
    """A preset by name; the error lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; known models: {', '.join(PRESETS)}"
        ) from None


def _field(config: dict, path: str, *names: str, default=None):
    """The first of ``names`` present in ``config``; without a default, missing is an error."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    if default is None:
        kind = config.get("model_type")
        raise ValueError(f"{path}: missing field {names[0]!r} (model_type {kind!r})")
    return default


def from_hf_config(path: str | Path) -> Architecture:
    """Read a Hugging Face ``config.json`` of a llama-, mistral-, gpt2- or
    gpt_neox-style model; a missing field is an error that names it."""
    path = str(path)
    config = read_json_object(path)
    kind = config.get("model_type")
    name = Path(path).parent.name or Path(path).stem
    if kind in ("llama", "mistral", "qwen2", "qwen3"):
        heads = _field(config, path, "num_attention_heads")
        return Architecture(
            name,
            hidden=_field(config, path, "hidden_size"),
            layers=_field(config, path, "num_hidden_layers"),
            heads=heads,
            ffn=_field(config, path, "intermediate_size"),
            vocab=_field(config, path, "vocab_size"),
            kv_heads=_field(config, path, "num_key_value_heads", default=heads),
            head_dim=config.get("head_dim"),
            tied=bool(config.get("tie_word_embeddings", False)),
            linear_bias=bool(config.get("attention_bias", False)),
        )
    if kind == "gpt2":
        hidden = _field(config, path, "n_embd", "hidden_size")
        return Architecture(
            name,
            hidden=hidden,
            layers=_field(config, path, "n_layer", "num_hidden_layers"),
            heads=_field(config, path, "n_head", "num_attention_heads"),
            ffn=config.get("n_inner") or 4 * hidden,
            vocab=_field(config, path, "vocab_size"),
            tied=bool(config.get("tie_word_embeddings", True)),
            max_positions=_field(config, path, "n_positions", "max_position_embeddings"),
            gated_mlp=False,
            norm_bias=True,
            linear_bias=True,
        )
    if kind == "gpt_neox":
        return Architecture(
            name,
            hidden=_field(config, path, "hidden_size"),
            layers=_field(config, path, "num_hidden_layers"),
            heads=_field(config, path, "num_attention_heads"),
            ffn=_field(config, path, "intermediate_size"),
            vocab=_field(config, path, "vocab_size"),
            tied=bool(config.get("tie_word_embeddings", False)),
            gated_mlp=False,
            norm_bias=True,
            linear_bias=True,
        )
    raise ValueError(
        f"{path}: model_type {kind!r} is not supported; expected one of "
        "llama, mistral, qwen2, qwen3, gpt2, gpt_neox"
    )


@dataclass(frozen=True)
class ModelSpec:
    """What the memory model needs: a parameter count and, for activations, shape."""

    name: str
    """Label shown in tables."""
    params: int
    """Total parameters P."""
    hidden: int | None = None
    """Width h; without it and ``layers`` activations are not modelled."""
    layers: int | None = None
    """Transformer blocks L."""
    heads: int | None = None
    """Attention heads; only the no-checkpointing formula needs them."""

    def __post_init__(self) -> None:
        if not isinstance(self.params, int) or self.params <= 0:
            raise ValueError(f"params={self.params!r} must be a positive integer")
        for field in ("hidden", "layers", "heads"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{field}={value!r} must be a positive integer")

    @classmethod
    def from_arch(cls, arch: Architecture) -> ModelSpec:
        return cls(arch.name, arch.params, arch.hidden, arch.layers, arch.heads)

    @classmethod
    def from_module(cls, module, name: str | None = None) -> ModelSpec:
        """Count an ``nn.Module``'s parameters (each shared tensor once).

        Duck-typed, so this module still imports no torch."""
        seen, total = set(), 0
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        return cls(name or type(module).__name__, total)

    @property
    def activations_modelled(self) -> bool:
        return self.hidden is not None and self.layers is not None
