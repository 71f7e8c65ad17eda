"""``zeroshard verify``'s trial: the run ``zeroshard train`` would make of the same flags —
its model (the built-in GPT or ``--hf-model``, with ``--lora``'s adapters), its
optimizer (``--optimizer``), its learning-rate schedule, clipping, engine settings and
its first K global batches — as a :class:`Trial`.

Each part is a small object holding the ``TrainConfig`` (picklable, for the ranks). A
shrunken model (``--layers``, ``--hidden``) keeps the architecture and the
configuration where the whole one cannot run on this machine: fewer layers load the
first layers' weights; another width builds the model with seeded random weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..train.settings import TrainConfig


@dataclass(frozen=True)
class Shrink:
    """A smaller model of the same architecture."""

    layers: int | None = None
    """Transformer blocks (None: the model's own)."""
    hidden: int | None = None
    """Model width (None: the model's own); weights are then random (seeded)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name}={value!r}; expected a positive integer")


def _builtin(cfg: TrainConfig, shrink: Shrink) -> nn.Module:
    from ..models.gpt import GPT, get_preset

    gpt = get_preset(cfg.model)
    changes = {k: v for k, v in dataclasses.asdict(shrink).items() if v is not None}
    if "hidden" in changes and changes["hidden"] % gpt.heads:
        raise ValueError(f"--hidden={changes['hidden']} does not divide into GPT {cfg.model}'s "
                         f"{gpt.heads} heads; give a multiple of {gpt.heads}")
    return GPT(dataclasses.replace(gpt, **changes))


def _hf(cfg: TrainConfig, shrink: Shrink) -> nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from ..models.hf import load_config

    config = load_config(cfg.hf_model)
    config.use_cache = False
    if shrink.layers is not None:
        config.num_hidden_layers = shrink.layers
    if shrink.hidden is not None:
        heads = config.num_attention_heads
        if shrink.hidden % heads:
            raise ValueError(f"--hidden={shrink.hidden} does not divide into the model's {heads} "
                             f"attention heads; give a multiple of {heads}")
        config.hidden_size = shrink.hidden
        if hasattr(config, "head_dim"):
            config.head_dim = shrink.hidden // heads
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # fewer layers: the rest of the file is left unread
    try:
        return AutoModelForCausalLM.from_pretrained(cfg.hf_model, config=config,
                                                    dtype=torch.float32,
                                                    local_files_only=True)
    finally:
        logging.set_verbosity(verbosity)


@dataclass(frozen=True)
class TrainModel:
    """``build_model``: the trainer's model, unsharded (``zs.shard`` shards it)."""

    cfg: TrainConfig
    shrink: Shrink = Shrink()

    def __call__(self) -> nn.Module:
        model = _hf(self.cfg, self.shrink) if self.cfg.hf_model else _builtin(self.cfg,
                                                                               self.shrink)
        if self.cfg.lora:
            from ..train.peftmodel import with_adapters

            model = with_adapters(model, self.cfg, builtin=not self.cfg.hf_model)
        return model


@dataclass(frozen=True)
class TrainTPPlan:
    """``tp_plan``: the trainer's tensor-parallel plan of the built model (the built-in
    GPT's ``GPT.TP_PLAN``, or the one transformers ships for the model)."""

    cfg: TrainConfig

    def __call__(self, model: nn.Module) -> dict:
        from ..models.tpplan import hf_plan

        if self.cfg.hf_model:
            return hf_plan(model)
        from ..models.gpt import GPT

        return GPT.TP_PLAN


@dataclass(frozen=True)
class TrainOptimizer:
    """``build_optimizer``: ``--optimizer`` as the trainer builds it."""

    cfg: TrainConfig

    def __call__(self, model: nn.Module):
        from ..train.optimizer import build_optimizer

        return build_optimizer(model, self.cfg)


@dataclass(frozen=True)
class TrainSchedule:
    """The trainer's learning-rate factor at each step (``train/lrschedule.py``)."""

    cfg: TrainConfig

    def __call__(self, step: int) -> float:
        from ..train.lrschedule import lr_lambda

        return lr_lambda(self.cfg)(step)


@dataclass(frozen=True)
class TrainLoss:
    """``loss``: the trainer's loss of a batch ``(x, y)``."""

    cfg: TrainConfig

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        if self.cfg.hf_model:
            from ..models.hf import lm_loss

            return lm_loss(model, x, y)
        return model(x, y)


def train_batches(cfg: TrainConfig, steps: int, vocab: int, seq_len: int) -> list:
    """The first ``steps`` global batches the trainer would read, whole."""
    from ..train.datasource import open_source, tokenized

    if cfg.data:  # tokenized once (cached beside the data), as the launcher does
        from ..corpus import open_corpus

        corpus = open_corpus(tokenized(cfg, vocab, seq_len, progress=False), seq_len)
    else:
        corpus = open_source(cfg, vocab, seq_len, 0)
    return [corpus.batch("train", cfg.seed, k, cfg.batch, seq_len, part=slice(0, cfg.batch))
            for k in range(steps)]
