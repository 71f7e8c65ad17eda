"""A checkpoint of LoRA fine-tuning (``zeroshard train --lora``) exported: the adapter in
peft's layout, or the model with the adapter merged into its weights.

The adapter is what peft's ``save_pretrained`` writes (``peft/utils/save_and_load.py``):
``adapter_model.safetensors``, each adapter tensor under its name without the adapter's
(``...q_proj.lora_A.weight``), and ``adapter_config.json``; peft's ``from_pretrained``
then loads it onto the base model. Merged, every adapted weight becomes
``W + scaling · B·A`` (transposed for a layer that stores ``W`` as ``[in, out]``,
GPT-2's ``Conv1D``: ``fan_in_fan_out``), as peft's ``LoraLayer.get_delta_weight``
merges it, with ``scaling = alpha / r`` (or peft's rsLoRA); the adapters go and the
names are the base model's. One weight and its adapter are held at a time.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from .consolidated import reader, write_entries
from .exportdir import put
from .load import peft_base_name
from .tensorfile import fsync_dir, write_tensors

ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def adapted_layers(peft_model, adapter: str = "default") -> dict[str, tuple[float, bool]]:
    """Per LoRA layer of ``peft_model`` (built on the meta device from the run's
    settings), its name and (scaling, fan_in_fan_out), as peft merges it."""
    from peft.tuners.lora import LoraLayer

    return {name: (m.scaling[adapter], bool(getattr(m, "fan_in_fan_out", False)))
            for name, m in peft_model.named_modules()
            if isinstance(m, LoraLayer) and adapter in m.lora_A}


def export_adapter(ckpt_path, out_dir: Path, config, dtype: str,
                   adapter: str = "default") -> dict:
    """peft's adapter files from the checkpoint: its ``lora_`` tensors, and ``config``
    (the run's ``peft.LoraConfig``) as ``adapter_config.json``."""
    manifest, assemble, _ = reader(ckpt_path, dtype)
    items = [(n, tuple(p["shape"])) for n, p in manifest["params"].items() if ".lora_" in n]
    entries = [(n.replace(f".{adapter}.", "."), s, torch.float32 if dtype == "fp32"
                else torch.bfloat16, lambda n=n, s=s: assemble(n, s)) for n, s in items]
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)  # peft's own JSON
        text = (Path(tmp) / ADAPTER_CONFIG).read_bytes()
    out_dir = Path(out_dir)
    written = {}
    for name, write in ((ADAPTER_FILE, lambda p: write_tensors(str(p), entries,
                                                               {"format": "pt"})),
                        (ADAPTER_CONFIG, lambda p: p.write_bytes(text))):
        put(out_dir, name, write)
        written[name] = [e[0] for e in entries] if name == ADAPTER_FILE else []
    fsync_dir(str(out_dir))
    return written


def export_merged(ckpt_path, out_dir: Path, layers: dict[str, tuple[float, bool]],
                  dtype: str, max_shard_bytes: int, adapter: str = "default") -> dict:
    """The base model's weights from the checkpoint with each adapter merged into the
    weight it adapts, under the base model's names (what ``from_pretrained`` loads)."""
    manifest, assemble, buffer = reader(ckpt_path, "fp32")
    out_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    shapes = {n: tuple(p["shape"]) for n, p in manifest["params"].items()}

    def merged(name: str, shape):
        w = assemble(name, shape)
        layer = name.rsplit(".base_layer.", 1)[0] if ".base_layer.weight" in name else None
        if layer in layers:
            scaling, fan_in_fan_out = layers[layer]
            a_name, b_name = (f"{layer}.lora_{x}.{adapter}.weight" for x in "AB")
            delta = assemble(b_name, shapes[b_name]) @ assemble(a_name, shapes[a_name])
            w = w + scaling * (delta.T if fan_in_fan_out else delta)
        return w.to(out_dtype)

    entries = [(peft_base_name(n), s, out_dtype, lambda n=n, s=s: merged(n, s))
               for n, s in shapes.items() if peft_base_name(n) is not None]
    skip = set(manifest.get("nonpersistent", ()))
    for n, s in manifest["buffers"].items():
        if n not in skip:
            value = buffer(n)
            bdtype = out_dtype if value.dtype.is_floating_point else value.dtype
            entries.append((peft_base_name(n), tuple(s), bdtype,
                            lambda n=n, t=bdtype: buffer(n).to(t)))
    return write_entries(Path(out_dir), entries, max_shard_bytes)
