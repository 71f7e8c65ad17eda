"""Peak host memory of `zeroshard import-deepspeed` against the model's size.

    DS_ACCELERATOR=cpu python bench/import_memory.py [--layers 8 --hidden 1024 --stage 3]

DeepSpeed (2 gloo ranks, AdamW, fp32) trains a GPT one step and saves a ZeRO checkpoint;
then, each in a fresh process, `zeroshard import-deepspeed` converts it (weights and Adam
state) and DeepSpeed's own zero_to_fp32 consolidates its weights, and each reports how much
its process's peak resident set grew. Needs DeepSpeed installed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

_ZERO_TO_FP32 = """
import resource, sys
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
imported = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
state = get_fp32_state_dict_from_zero_checkpoint(sys.argv[1])
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - imported
print(f"zero_to_fp32 (weights only): peak host memory grew by {grown / 1e6:.1f} MB")
"""


def _train_and_save(root: str, layers: int, hidden: int, stage: int) -> tuple[int, int]:
    import importlib
    import logging
    import types

    import torch

    from zeroshard.models.gpt import GPT, GPTConfig

    os.environ["DS_ACCELERATOR"] = "cpu"
    muon = types.ModuleType("deepspeed.runtime.zero.muon.muon_optimizer")  # (see the tests)
    muon.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {})
    sys.modules.setdefault(muon.__name__, muon)
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.utils.logger.setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=256, block_size=128, layers=layers, heads=8, hidden=hidden))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9})
    idx = torch.randint(0, 256, (2, 128))
    engine.backward(engine(idx, idx))
    engine.step()
    engine.save_checkpoint(root)
    sizes = [getattr(p, "ds_numel", p.numel()) for p in model.parameters()]  # (stage 3: ds_)
    return sum(sizes), max(sizes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        _measure(root, a)


def _measure(root: str, a) -> None:
    from zeroshard.runtime.spawn import spawn

    ds = os.path.join(root, "ds")
    numel, largest = spawn(_train_and_save, 2, ds, a.layers, a.hidden, a.stage,
                           timeout=1800)[0]
    tag = open(os.path.join(ds, "latest")).read().strip()
    size = sum(os.path.getsize(os.path.join(ds, tag, f)) for f in os.listdir(os.path.join(ds, tag)))
    print(f"ZeRO-{a.stage} checkpoint of {numel / 1e6:.1f} M parameters: fp32 weights "
          f"{numel * 4 / 1e6:.1f} MB, {size / 1e6:.1f} MB on disk (2 ranks), largest parameter "
          f"{largest * 4 / 1e6:.1f} MB in fp32")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20), DS_ACCELERATOR="cpu")
    for cmd in ([sys.executable, "-m", "zeroshard", "import-deepspeed", ds,
                 os.path.join(root, "zs")],
                [sys.executable, "-c", _ZERO_TO_FP32, ds]):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        print(out.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
