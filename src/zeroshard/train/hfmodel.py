"""The model ``zeroshard train`` trains: the built-in GPT, or a Hugging Face causal LM
from a local folder (``--hf-model``). Each says what it is and how long its sequences
are, builds itself sharded, computes its loss and samples text; the loop does not ask
which one it has."""

from __future__ import annotations

from pathlib import Path

import torch

from .. import shard
from ..plan.arch import Architecture
from .peftmodel import adapter_init, with_adapters
from .settings import TrainConfig


def gpt_architecture(c) -> Architecture:
    """The built-in GPT of ``GPTConfig`` ``c`` as the planner describes models."""
    return Architecture("gpt", c.hidden, c.layers, c.heads, 4 * c.hidden, c.vocab, tied=True,
                        max_positions=c.block_size, gated_mlp=False, norm_bias=True,
                        linear_bias=True, family="gpt", naming="zeroshard")


def _zeros(module: torch.nn.Module) -> None:
    """The meta model's placeholder initialisation: its weights are read from the files
    right after, so a unit is materialized without running any initialiser."""
    for p in module._parameters.values():
        if p is not None:
            p.zero_()


class BuiltinGPT:
    """The built-in GPT preset ``cfg.model``, byte-level, on the built-in corpus."""

    vocab = 256
    loss_outside = False
    """The loss is computed inside the model's forward (``GPT.forward`` given targets)."""

    def __init__(self, cfg: TrainConfig):
        from ..models.gpt import get_preset

        self.cfg, self.gpt_cfg = cfg, get_preset(cfg.model)
        block = self.gpt_cfg.block_size
        if cfg.seq_len is not None and cfg.seq_len > block:
            raise ValueError(f"seq_len={cfg.seq_len} is above GPT {cfg.model}'s block size "
                             f"{block}; give --seq-len {block} or less")
        self.seq_len = cfg.seq_len or block
        self.label, self.source = f"GPT {cfg.model}", ""

    def meta(self) -> torch.nn.Module:
        """The model as the run builds it (with ``--lora``'s adapters), on the meta device
        (no memory)."""
        from ..models.gpt import GPT

        with torch.device("meta"):
            model = GPT(self.gpt_cfg)
            return with_adapters(model, self.cfg, builtin=True) if self.cfg.lora else model

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter names and shapes, as the run's model has them."""
        return {n: tuple(p.shape) for n, p in self.meta().named_parameters()}

    def params(self) -> int:
        """Every parameter the run's model holds, ``--lora``'s adapters included."""
        return sum(_numel(s) for s in self.shapes().values())

    def build(self, load_weights: bool = True):
        from ..models.gpt import GPT

        torch.manual_seed(self.cfg.seed)
        model = GPT(self.gpt_cfg)
        if self.cfg.lora:
            model = with_adapters(model, self.cfg, builtin=True)
        return _sharded(model, self.cfg, GPT.TP_PLAN, self.label, self.tp_sizes)

    def tp_sizes(self) -> dict[str, int]:
        """What tensor parallelism splits (``GPT.TP_PLAN``): the heads and the widths."""
        c = self.gpt_cfg
        return {"heads": c.heads, "hidden size": c.hidden, "MLP width": 4 * c.hidden}

    def loss(self, model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return model(x, y)

    def sample(self, model, device) -> str:
        from ..data import decode
        from ..models.gpt import GPT

        prompt = torch.tensor([list(b"The ")], device=device)
        g = torch.Generator().manual_seed(self.cfg.seed)
        text = GPT.generate(model.module, prompt, self.cfg.sample_chars, generator=g,
                            forward=model)
        return decode(text[0].tolist())

    def architecture(self) -> Architecture:
        """The planner's description of the model (``zeroshard train --profile``)."""
        return gpt_architecture(self.gpt_cfg)


class HFCausalLM:
    """A Hugging Face causal LM from ``cfg.hf_model``: built on the meta device, each
    rank reading the rows it keeps from the safetensors, unit by unit."""

    loss_outside = True
    """The loss is a cross-entropy on the logits the model returns (``models/hf.lm_loss``),
    computed after the model's forward."""

    def __init__(self, cfg: TrainConfig):
        from ..models.hf import describe

        self.cfg, self.info = cfg, describe(cfg.hf_model)
        limit = self.info.max_positions
        self.seq_len = cfg.seq_len or min(limit or 1024, 1024)
        if limit is not None and self.seq_len > limit:
            raise ValueError(f"seq_len={self.seq_len} is above {self.info.architecture}'s "
                             f"longest sequence, {limit} (its config.json); give --seq-len "
                             f"{limit} or less")
        self.vocab = self.info.vocab
        if not cfg.data and self.vocab < 256:
            raise ValueError(f"hf_model={cfg.hf_model!r} has a vocabulary of {self.vocab}; "
                             "the built-in corpus is bytes (ids up to 255): give --data to "
                             "train on text tokenized by the model's tokenizer")
        self.label = f"Hugging Face {self.info.architecture}"
        self.source = f" from {cfg.hf_model}"

    def meta(self) -> torch.nn.Module:
        """The model as the run builds it (with ``--lora``'s adapters), on the meta device."""
        from ..models.hf import build_meta

        model = build_meta(self.cfg.hf_model)
        return with_adapters(model, self.cfg, builtin=False) if self.cfg.lora else model

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter names and shapes, as the run's model has them."""
        return {n: tuple(p.shape) for n, p in self.meta().named_parameters()}

    def params(self) -> int:
        """Every parameter the run's model holds, ``--lora``'s adapters included."""
        return sum(_numel(s) for s in self.shapes().values())

    def build(self, load_weights: bool = True):
        """Sharded, with the folder's weights (``load_weights=False``: a checkpoint's
        weights replace them next, so they are not read)."""
        from ..checkpoint.hflayout import load_hf_weights
        from ..models.hf import build_meta
        from ..models.tpplan import hf_plan

        module, init = build_meta(self.cfg.hf_model), _zeros
        if self.cfg.lora:  # peft's adapters, initialised as peft does (train/peftmodel.py)
            module = with_adapters(module, self.cfg, builtin=False)
            init = adapter_init(module, _zeros)
        plan = hf_plan(module) if self.cfg.tp > 1 else {}
        model = _sharded(module, self.cfg, plan, self.info.architecture, self.tp_sizes,
                         param_init=init, seed=self.cfg.seed)
        if load_weights:
            load_hf_weights(model, self.cfg.hf_model)
        return model

    def tp_sizes(self) -> dict[str, int]:
        """What transformers' plan splits: the heads, the key/value heads, the MLP width
        and the vocabulary (its embedding and head are vocabulary-parallel)."""
        from ..models.hf import load_config

        config = load_config(self.cfg.hf_model)
        heads = config.num_attention_heads
        return {"attention heads": heads,
                "key/value heads": getattr(config, "num_key_value_heads", None) or heads,
                "MLP width": getattr(config, "intermediate_size", 0), "vocabulary": self.vocab}

    def loss(self, model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from ..models.hf import lm_loss

        return lm_loss(model, x, y)

    def tokenizer(self):
        """The folder's tokenizer, for the sample (checked before launch when one is
        wanted: a run should not train for hours and then fail to print it)."""
        from transformers import AutoTokenizer

        folder = Path(self.cfg.hf_model)
        if not any(folder.glob("tokenizer*")) and not any(folder.glob("vocab.*")):
            raise ValueError(f"hf_model={self.cfg.hf_model!r} has no tokenizer (no "
                             "tokenizer.json, tokenizer_config.json or vocab file); save one "
                             "beside the model (tokenizer.save_pretrained), or give "
                             "--sample-chars 0")
        try:
            return AutoTokenizer.from_pretrained(self.cfg.hf_model, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many types; one line
            text = (str(exc).strip() or type(exc).__name__).splitlines()[0]
            raise ValueError(f"hf_model={self.cfg.hf_model!r}: its tokenizer cannot be "
                             f"loaded ({text}); save one beside the model "
                             "(tokenizer.save_pretrained), or give --sample-chars 0") from None

    def sample(self, model, device) -> str:
        """About ``sample_chars`` characters: a token is some 4 characters of English."""
        from ..models.hf import sample

        tokenizer = self.tokenizer()
        prompt = tokenizer.encode("The ")
        g = torch.Generator().manual_seed(self.cfg.seed)
        new = sample(model, prompt, max(1, self.cfg.sample_chars // 4), self.seq_len, g, device)
        return tokenizer.decode(prompt + new)

    def architecture(self):
        from ..plan.hfconfig import from_hf_config

        return from_hf_config(Path(self.cfg.hf_model) / "config.json")


def _sharded(model, cfg: TrainConfig, plan: dict, label: str, sizes, **options):
    """``model`` sharded as ``cfg`` says; with ``cfg.tp`` > 1 first parallelized by
    ``plan`` with torch's styles over the ``"tp"`` dim of a ``(dp, tp)`` mesh, every size
    it splits (``sizes()``) checked to divide by tp (``models/tpplan.py``)."""
    if cfg.tp == 1:
        return shard(model, config=cfg.zero, **options)
    from ..models.tpplan import parallelize
    from ..runtime.mesh import tensor_parallel_mesh
    from ..spec.dims import check_tp_degree

    check_tp_degree(cfg.tp, label, sizes())
    mesh = tensor_parallel_mesh(cfg.tp, cfg.zero.shard_group)
    parallelize(model, mesh["tp"], plan)
    return shard(model, config=cfg.zero, mesh=mesh, **options)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def model_source(cfg: TrainConfig) -> BuiltinGPT | HFCausalLM:
    """The model of ``cfg``: checked (its folder, its sequence length) before anything is
    built."""
    return HFCausalLM(cfg) if cfg.hf_model else BuiltinGPT(cfg)
