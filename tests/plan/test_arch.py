"""Parameter counts held against the models transformers itself builds (on the meta
device: no memory, no weights): every preset, and every ``--hf-config`` family with
each bias and norm option it reads."""

from __future__ import annotations

import json

import pytest

from zeroshard.plan import PRESETS, from_hf_config

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def hf_config(name: str) -> dict:
    """A preset written as the config.json its model's authors publish."""
    a = PRESETS[name]
    if a.family == "gpt":
        return {"model_type": "gpt2", "n_embd": a.hidden, "n_layer": a.layers,
                "n_head": a.heads, "vocab_size": a.vocab, "n_positions": a.max_positions}
    if a.family == "neox":
        return {"model_type": "gpt_neox", "hidden_size": a.hidden,
                "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
                "intermediate_size": a.ffn, "vocab_size": a.vocab,
                "tie_word_embeddings": a.tied}
    kind = ("gemma2" if a.family == "gemma2" else "qwen3" if a.qk_norm else
            "qwen2" if a.qkv_bias else "mistral" if name.startswith("mistral") else "llama")
    out = {"model_type": kind, "hidden_size": a.hidden, "num_hidden_layers": a.layers,
           "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads or a.heads,
           "intermediate_size": a.ffn, "vocab_size": a.vocab, "tie_word_embeddings": a.tied}
    if a.head_dim is not None:
        out["head_dim"] = a.head_dim
    return out


def meta_count(config: dict) -> int:
    """Parameters of the causal LM transformers builds from ``config`` (each once)."""
    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def write(tmp_path, config: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_counts_are_transformers_counts(name, tmp_path):
    config = hf_config(name)
    assert from_hf_config(write(tmp_path, config)).params == PRESETS[name].params
    assert meta_count(config) == PRESETS[name].params


SMALL = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 2, "intermediate_size": 688, "vocab_size": 1000}


@pytest.mark.parametrize("config", [
    {"model_type": "llama", **SMALL},
    {"model_type": "llama", **SMALL, "attention_bias": True},
    {"model_type": "llama", **SMALL, "mlp_bias": True},
    {"model_type": "llama", **SMALL, "attention_bias": True, "mlp_bias": True,
     "tie_word_embeddings": True},
    {"model_type": "llama", **SMALL, "head_dim": 64},
    {"model_type": "mistral", **SMALL},
    {"model_type": "qwen2", **SMALL},
    {"model_type": "qwen2", **SMALL, "tie_word_embeddings": True},
    {"model_type": "qwen3", **SMALL},
    {"model_type": "qwen3", **SMALL, "head_dim": 32, "attention_bias": True},
    {"model_type": "gemma2", **SMALL},
    {"model_type": "gemma2", **SMALL, "head_dim": 48, "tie_word_embeddings": False},
    {"model_type": "gpt2", "n_embd": 256, "n_layer": 2, "n_head": 8, "vocab_size": 1000,
     "n_positions": 128, "n_inner": 600},
    {"model_type": "gpt_neox", **SMALL, "num_key_value_heads": 8},
    {"model_type": "gpt_neox", **SMALL, "num_key_value_heads": 8, "tie_word_embeddings": True},
], ids=lambda c: "-".join(f"{k}" for k in c if k not in SMALL))
def test_family_counts_are_transformers_counts(config, tmp_path):
    assert from_hf_config(write(tmp_path, config)).params == meta_count(config)
