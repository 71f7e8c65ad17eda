"""A Hugging Face ``config.json`` read into an :class:`~.arch.Architecture`.

Each family reads the fields its transformers model class reads, with the same
defaults, so the parameter count is the one transformers builds (checked in
``tests/plan/test_arch.py`` against the models built on the meta device):

- llama: ``attention_bias`` puts biases on q, k, v and o; ``mlp_bias`` on gate, up, down;
- mistral: no biases;
- qwen2: q, k and v always carry biases (the config has no flag for it), o does not;
- qwen3: per-head RMSNorms on q and k, ``head_dim`` 128 unless given, ``attention_bias``;
- gemma2: four norms per block, ``head_dim`` 256 unless given, the head tied by default;
- gpt2: every projection biased, learned positions, the head tied by default, dropout
  on the residual stream, the embeddings and the attention probabilities (0.1 each
  unless given);
- gpt_neox: every projection biased, LayerNorm, parallel residual.
"""

from __future__ import annotations

from pathlib import Path

from .._jsonfile import read_json_object
from .arch import Architecture

KINDS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gpt2", "gpt_neox")


def _field(config: dict, path: str, *names: str, default=None):
    """The first of ``names`` present in ``config``; without a default, missing is an error."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    if default is None:
        kind = config.get("model_type")
        raise ValueError(f"{path}: missing field {names[0]!r} (model_type {kind!r})")
    return default


def _rotary_fraction(config: dict) -> float:
    """GPT-NeoX's rotated share of each head: ``rope_parameters`` (transformers 5) or
    ``rotary_pct`` (earlier), 0.25 when neither says."""
    rope = config.get("rope_parameters") or {}
    return float(rope.get("partial_rotary_factor", config.get("rotary_pct", 0.25)))


def _rotary(config: dict, path: str, name: str, kind: str) -> Architecture:
    heads = _field(config, path, "num_attention_heads")
    attention_bias = bool(config.get("attention_bias", False))
    head_dim = config.get("head_dim")
    if head_dim is None and kind in ("qwen3", "gemma2"):
        head_dim = 128 if kind == "qwen3" else 256  # the transformers config defaults
    return Architecture(
        name,
        hidden=_field(config, path, "hidden_size"),
        layers=_field(config, path, "num_hidden_layers"),
        heads=heads,
        ffn=_field(config, path, "intermediate_size"),
        vocab=_field(config, path, "vocab_size"),
        kv_heads=_field(config, path, "num_key_value_heads", default=heads),
        head_dim=head_dim,
        tied=bool(config.get("tie_word_embeddings", kind == "gemma2")),
        qkv_bias=attention_bias or kind == "qwen2",
        o_bias=attention_bias and kind != "qwen2",
        mlp_bias=bool(config.get("mlp_bias", False)) and kind == "llama",
        qk_norm=kind == "qwen3",
        norms=4 if kind == "gemma2" else 2,
        family="gemma2" if kind == "gemma2" else "llama",
    )


def from_hf_config(path: str | Path) -> Architecture:
    """Read a Hugging Face ``config.json`` of one of :data:`KINDS`; a missing field is an
    error that names it."""
    path = str(path)
    config = read_json_object(path)
    kind = config.get("model_type")
    name = Path(path).parent.name or Path(path).stem
    if kind in ("llama", "mistral", "qwen2", "qwen3", "gemma2"):
        return _rotary(config, path, name, kind)
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
            family="gpt",
            gelu_tanh_unfused=config.get("activation_function", "gelu_new") == "gelu_new",
            dropout=_field(config, path, "resid_pdrop", default=0.1),
            embedding_dropout=_field(config, path, "embd_pdrop", default=0.1),
            attention_dropout=_field(config, path, "attn_pdrop", default=0.1),
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
            family="neox" if config.get("use_parallel_residual", True) else "gpt",
            rotary_fraction=_rotary_fraction(config),
            naming="neox",
        )
    raise ValueError(
        f"{path}: model_type {kind!r} is not supported; expected one of {', '.join(KINDS)}"
    )
