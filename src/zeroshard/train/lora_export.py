"""``zeroshard export`` of a ``zeroshard train --lora`` run: its adapter in peft's layout,
or the model with the adapter merged (``checkpoint/loraexport.py`` writes both; the run's
settings, read back from the checkpoint, say which layers peft adapted and how)."""

from __future__ import annotations

import torch

from .peftmodel import peft_config, with_adapters


def export(ckpt, out, dtype: str, max_shard_bytes: int, merge: bool) -> str | None:
    """``zeroshard export`` of a ``--lora`` run's checkpoint: peft's adapter files, or with
    ``merge`` the model with the adapter merged (a Hugging Face folder, its config and
    tokenizer carried over). Returns what was written, in words; None for a checkpoint
    trained without adapters (``merge`` is then refused)."""
    from ..checkpoint.exportdir import check as check_out_dir
    from ..checkpoint.hflayout import carry_over, check_export
    from ..checkpoint.loraexport import (
        ADAPTER_CONFIG,
        ADAPTER_FILE,
        adapted_layers,
        export_adapter,
        export_merged,
    )
    from ..checkpoint.sharded import read_manifest, resolve
    from .settings import TrainConfig

    saved = read_manifest(resolve(ckpt))["extra"].get("config") or {}
    if not isinstance(saved, dict) or not saved.get("lora"):
        if merge:
            raise ValueError(f"--merge merges LoRA adapters into the weights; {ckpt} was "
                             "trained without them (no --lora): export it without --merge")
        return None
    cfg = TrainConfig.from_dict(saved, where=f"{ckpt}'s settings")
    builtin = not cfg.hf_model
    if not merge:
        out = check_out_dir(out, (ADAPTER_FILE, ADAPTER_CONFIG), weights=False)
        written = export_adapter(ckpt, out, _adapter_config(cfg, builtin), dtype)
        return f"the LoRA r={cfg.lora} adapter ({len(written['adapter_model.safetensors'])} " \
               "tensors) in peft's layout"
    if cfg.hf_model:
        check_export(cfg.hf_model, out)
    out = check_out_dir(out, _carried(cfg))
    layers = adapted_layers(_meta_model(cfg, builtin))
    layout = export_merged(ckpt, out, layers, dtype, max_shard_bytes)
    copied = carry_over(cfg.hf_model, out, dtype) if cfg.hf_model else []
    also = f", and {', '.join(copied)} from {cfg.hf_model}" if copied else ""
    count = sum(len(v) for v in layout.values())
    return f"{count} tensors with {len(layers)} adapters merged{also}"


def _carried(cfg) -> list[str]:
    """The files a merged export copies from the run's model folder."""
    from ..checkpoint.hflayout import carried_files

    return [p.name for p in carried_files(cfg.hf_model)] if cfg.hf_model else []


def _adapter_config(cfg, builtin: bool):
    config = peft_config(cfg, builtin)
    if cfg.hf_model:
        config.base_model_name_or_path = cfg.hf_model
    return config


def _meta_model(cfg, builtin: bool):
    """The run's model with its adapters, on the meta device: which layers peft adapted,
    with what scale and orientation."""
    if builtin:
        from ..models.gpt import GPT, get_preset

        with torch.device("meta"):
            return with_adapters(GPT(get_preset(cfg.model)), cfg, builtin=True)
    from ..models.hf import build_meta

    return with_adapters(build_meta(cfg.hf_model), cfg, builtin=False)
