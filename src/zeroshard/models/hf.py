"""A Hugging Face causal language model from a local directory, built on the meta device.

The directory is what ``save_pretrained`` writes: ``config.json``, safetensors weights
(``model.safetensors``, or shards named by ``model.safetensors.index.json``) and a
tokenizer. Nothing is downloaded (``local_files_only``), and no code from the directory
runs (no ``trust_remote_code``): the architecture is one transformers ships.

The model is built with its parameters on the meta device and its buffers real
(:func:`params_on_meta`, the approach of accelerate's
``init_empty_weights(include_buffers=False)``): buffers such as rotary frequency tables
are computed by the model's own constructor, cost little, and no generic initialiser
could recompute them; parameters cost nothing until the engine materializes them one
unit at a time and each rank reads its own rows from the weights
(``zeroshard.checkpoint.hflayout.load_hf_weights``, which also finds the weight files:
``weight_files``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checkpoint.hflayout import weight_files

CONFIG = "config.json"

#: Config fields that carry the longest sequence a model takes, by family (Llama, Mistral,
#: Qwen2, GPT-NeoX: max_position_embeddings; GPT-2: n_positions).
_MAX_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")


@dataclass(frozen=True)
class HFModel:
    """What the trainer needs to know of a model directory, read without building it."""

    path: str
    architecture: str
    """The transformers class it builds, e.g. ``LlamaForCausalLM``."""
    model_type: str
    vocab: int
    max_positions: int | None
    """The longest sequence the model takes (None: the config does not say)."""

    def __post_init__(self) -> None:
        if self.vocab <= 0:
            raise ValueError(f"hf_model={self.path!r}: vocab_size={self.vocab} in {CONFIG}")


def _where(path: str | Path) -> str:
    return f"hf_model={str(path)!r}"


def load_config(path: str | Path):
    """The transformers config of ``path``, read locally; one line naming what is wrong."""
    from transformers import AutoConfig

    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{_where(path)}: no such folder; give a Hugging Face model folder "
                         f"({CONFIG}, safetensors weights and a tokenizer)")
    if not (p / CONFIG).is_file():
        raise ValueError(f"{_where(path)}: no {CONFIG}, so not a Hugging Face model folder "
                         f"(expected {CONFIG}, safetensors weights and a tokenizer)")
    try:
        return AutoConfig.from_pretrained(str(p), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types; one line each
        raise ValueError(f"{_where(path)}: transformers cannot read {p / CONFIG}: "
                         f"{_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def describe(path: str | Path) -> HFModel:
    """Read ``path``'s config and check that transformers can build it as a causal LM and
    that its weights are there; nothing is built."""
    from transformers import AutoModelForCausalLM

    config = load_config(path)
    mapping = AutoModelForCausalLM._model_mapping
    if type(config) not in mapping:
        kind = getattr(config, "model_type", "?")
        raise ValueError(f"{_where(path)}: transformers cannot build model_type {kind!r} "
                         f"({type(config).__name__}) as a causal language model; expected "
                         "one AutoModelForCausalLM builds, such as llama, mistral, qwen2, "
                         "gpt2 or gpt_neox")
    weight_files(path)
    limit = next((getattr(config, k) for k in _MAX_POSITIONS
                  if isinstance(getattr(config, k, None), int)), None)
    return HFModel(str(path), mapping[type(config)].__name__, config.model_type,
                   int(getattr(config, "vocab_size", 0) or 0), limit)


@contextlib.contextmanager
def params_on_meta():
    """Inside, every parameter a module registers goes to the meta device; buffers stay
    where they are made."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def build_meta(path: str | Path) -> nn.Module:
    """The model of ``path`` in fp32, parameters on the meta device (tied ones tied)."""
    from transformers import AutoModelForCausalLM

    config = load_config(path)
    config.use_cache = False  # training reads whole sequences; no key-value cache
    with params_on_meta():
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except Exception as exc:  # noqa: BLE001 - one line, whatever transformers raised
            raise ValueError(f"{_where(path)}: transformers cannot build "
                             f"{type(config).__name__} as a causal language model: "
                             f"{_first_line(exc)}") from None
    return model


def param_count(model: nn.Module) -> int:
    """Parameters, a tied one counted once (``parameters()`` yields it once)."""
    return sum(p.numel() for p in model.parameters())


def lm_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``model`` (a causal LM, sharded or not) on inputs
    ``x`` against targets ``y``, both ``[rows, seq_len]``, in fp32 whatever the compute
    dtype (the built-in GPT's loss is computed the same way)."""
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def sample(model, prompt: list[int], tokens: int, window: int, generator: torch.Generator,
           device, temperature: float = 0.8) -> list[int]:
    """``tokens`` sampled after ``prompt``, each from the last ``window`` tokens, without
    a cache: every rank calls the model alike and draws alike from its own generator
    seeded the same, so stage-3 gathers pair up (``GPT.generate``'s way)."""
    ids = list(prompt)
    for _ in range(tokens):
        x = torch.tensor([ids[-window:]], device=device)
        logits = model(input_ids=x, use_cache=False).logits[0, -1].float()
        probs = torch.softmax(logits / temperature, dim=-1).cpu()
        ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    return ids[len(prompt):]
