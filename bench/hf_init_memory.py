"""Peak host memory of loading a Hugging Face model sharded at stage 3: ``from_pretrained``
whole then sharded, or the trainer's way (``zeroshard train --hf-model``): built on the
meta device, each rank reading the rows it keeps from the safetensors, unit by unit.

    python bench/hf_init_memory.py [--layers 8 --hidden 1024 --vocab 32000 --nproc 2]

A Llama of the given size is saved (random weights, sharded files with an index) into a
temporary folder first. Each way runs in fresh processes; the figure is the growth of
each rank's peak resident set (VmHWM, reset first) while the model is built, sharded and its
weights read, beside the bytes of the full model, a decoder layer, the largest unit (the
root: embeddings, head and final norm, at this vocabulary) and this rank's weight shard
(at stage 3 the only per-parameter memory a rank holds after construction).
"""

from __future__ import annotations

import argparse


def _status(field: str) -> int:
    """A byte count of this process from /proc/self/status (VmRSS, VmHWM)."""
    with open("/proc/self/status") as fh:
        line = next(x for x in fh if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> int:
    """Set this process's peak resident set to its current one (Linux: clear_refs 5, see
    proc(5)), so the peak measured next is of what follows, not of the imports before;
    return the current resident set."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return _status("VmRSS")


def _rank(folder: str, trainer: bool) -> dict:
    import torch

    import zeroshard as zs
    from zeroshard.spec.config import ZeroConfig
    from zeroshard.train.hfmodel import HFCausalLM
    from zeroshard.train.settings import TrainConfig

    # warm-up: imports, process groups, transformers' lazy modules, first-use buffers
    warm = zs.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), stage=3)
    del warm
    source = HFCausalLM(TrainConfig(hf_model=folder, data="unused", zero=ZeroConfig(stage=3)))
    source.shapes()
    before = _reset_peak()
    if trainer:
        net = source.build()
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        with torch.no_grad():  # from_pretrained's tensors view the memory-mapped files,
            for p in model.parameters():  # whose storage the engine cannot free: copy
                p.data = p.data.clone()
        net = zs.shard(model, stage=3)
    peak = _status("VmHWM") - before
    sizes = {u.name: sum(p.numel() for p in u.params) * 4 for u in net.units}
    largest = max(sizes, key=sizes.get)
    return {"peak": peak, "unit": sizes[largest], "unit_name": largest,
            "layer": sizes[net.units[-1].name], "shard": net.memory()["params"],
            "full": sum(sizes.values())}


def main() -> None:
    import os
    import tempfile

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from zeroshard.runtime.spawn import spawn

    # A fixed mmap threshold: glibc then returns every large freed block to the system at
    # once, so the resident peak counts live tensors rather than the allocator's hoard.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden,
                         intermediate_size=a.hidden * 11 // 4, num_hidden_layers=a.layers,
                         num_attention_heads=max(1, a.hidden // 64), max_position_embeddings=512)
    with tempfile.TemporaryDirectory(prefix="hf-init-memory-") as folder:
        with torch.device("meta"):
            LlamaForCausalLM(config)  # fail fast on a bad size, before anything is written
        model = LlamaForCausalLM(config)
        model.save_pretrained(folder, max_shard_size="50MB")
        del model
        whole = spawn(_rank, a.nproc, folder, False, timeout=900)[0]
        meta = spawn(_rank, a.nproc, folder, True, timeout=900)[0]
    mb = 1e6
    print(f"Llama {a.layers} layers x {a.hidden}, vocab {a.vocab}: full model "
          f"{meta['full'] / mb:.1f} MB, a decoder layer {meta['layer'] / mb:.1f} MB, the "
          f"largest unit ({meta['unit_name']}) {meta['unit'] / mb:.1f} MB, rank 0's weight "
          f"shard {meta['shard'] / mb:.1f} MB (N = {a.nproc})")
    print(f"peak growth, from_pretrained whole then sharded: {whole['peak'] / mb:.1f} MB "
          f"= {whole['peak'] / meta['full']:.2f} x the model")
    print(f"peak growth, meta + each rank's rows, unit by unit: {meta['peak'] / mb:.1f} MB "
          f"= shard + {(meta['peak'] - meta['shard']) / meta['unit']:.2f} x the largest unit")


if __name__ == "__main__":
    main()
