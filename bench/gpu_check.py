"""The CUDA/NCCL checks, as one short script for a machine with a GPU (one is enough).

    python bench/gpu_check.py --out DIR

1. The GPU tests (``-m gpu``: the engine on NCCL, the quantize kernels on CUDA against
   the CPU's, bit for bit).
2. Offload on the device: peak device memory (``torch.cuda.max_memory_allocated``) of
   two training steps of GPT medium at stage 3 in bf16 with ``offload`` None,
   "optimizer" and "params", beside the engine's own ledger by placement; and a
   ``torch.profiler`` trace of the offloaded step (``DIR/offload-trace.json``), in which
   the gradient copies to the host (Memcpy DtoH) should fall inside backward.
3. hpZ and the quantized collectives on one NCCL rank run their single-rank paths.

Writes ``DIR/gpu_check.json`` and prints it. Exits 1 if any part fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _offload(out: Path) -> dict:
    import torch

    import zeroshard as zs
    from zeroshard.data import Corpus
    from zeroshard.models.gpt import GPT, get_preset

    zs.init_distributed()
    cfg, corpus, rows = get_preset("medium"), Corpus.builtin(), 8
    results = {}
    for offload in (None, "optimizer", "params"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        net = zs.shard(GPT(cfg), stage=3, mixed_precision="bf16", offload=offload)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        prof = None
        for step in range(2):
            x, y = corpus.batch("train", 0, step, rows, cfg.block_size)
            if offload == "optimizer" and step == 1:
                prof = torch.profiler.profile(activities=[
                    torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
                prof.__enter__()
            net(x.cuda(), y.cuda()).backward()
            placed = net.memory(opt, by_placement=True)
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        if prof is not None:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(str(out / "offload-trace.json"))
        results[str(offload)] = {"max_memory_allocated": torch.cuda.max_memory_allocated(),
                                 "ledger": placed}
        del net, opt
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu-check")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu",
                            str(ROOT / "tests")], capture_output=True, text=True)
    report["gpu_tests"] = {"rc": tests.returncode, "tail": tests.stdout[-2000:]}
    try:
        report["offload"] = _offload(out)
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        report["offload"] = {"error": f"{type(exc).__name__}: {exc}"}
    text = json.dumps(report, indent=1, default=str)
    (out / "gpu_check.json").write_text(text)
    print(text)
    return 0 if tests.returncode == 0 and "error" not in report["offload"] else 1


if __name__ == "__main__":
    sys.exit(main())
