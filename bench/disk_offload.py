"""Disk offload's host memory and speed against host offload (docs/offload.md).

Each mode trains the same MLP (``--layers`` Linear(width, width), bf16, stage 1 on one
gloo rank, AdamW fused) in a fresh process, so its resident memory starts clean:

* ``peak growth``: the most, over the steps, by which the process's peak RSS
  (``VmHWM``) during ``opt.step()`` exceeds its RSS just before it (gradients made final
  by ``clip_grad_norm_``, the heap trimmed), read from ``/proc/self/status`` with the
  peak reset through ``/proc/self/clear_refs`` before each step;
* ``held after``: RSS after the first step less its baseline (what the step keeps:
  host offload's moments, disk offload's buffers);
* ``step``: the median seconds of ``opt.step()`` over the timed steps.

    python bench/disk_offload.py --layers 12 --width 2048 --sub-group 4000000 --steps 5
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import tempfile
import time

import torch

import zeroshard as zs
from zeroshard.runtime.spawn import spawn


def _rss() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                if k in ("VmRSS", "VmHWM")}


def _run(mode: str, layers: int, width: int, sub: int, steps: int, where: str) -> dict:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    disk = dict(offload_dir=where, sub_group_size=sub) if mode == "disk" else {}
    net = zs.shard(mlp, stage=1, mixed_precision="bf16", offload="optimizer", units="blocks",
                   **disk)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    x = torch.randn(8, width)
    params = sum(p.numel() for p in net.parameters())
    times, growth, held = [], [], []
    for _ in range(steps):
        net(x).float().square().mean().backward()
        net.clip_grad_norm_(1.0)  # gradients final: what is left to the step is the step
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _rss()["VmRSS"]
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
        rss = _rss()
        growth.append(rss["VmHWM"] - base)
        held.append(rss["VmRSS"] - base)
        opt.zero_grad()
    placed = net.memory(opt, by_placement=True)
    return {"mode": mode, "params": params, "state_bytes": 12 * params,
            "sub_group_bytes": 12 * sub if mode == "disk" else None,
            "buffers": net.stepper.disk_step.buffer_bytes() if mode == "disk" else 0,
            "peak_growth": max(growth), "held_after": held[0],
            "step_s": statistics.median(times[1:] or times),
            "placed": {w: sum(v.values()) for w, v in placed.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--sub-group", type=int, default=4_000_000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="zs-disk-bench-", dir=".") as where:
        for mode in ("host", "disk"):
            rows += spawn(_run, 1, mode, args.layers, args.width, args.sub_group, args.steps,
                          where, timeout=1800)
    mb = 1e6
    print(f"{'mode':5} {'params':>9} {'state MB':>9} {'sub-group MB':>12} {'buffers MB':>10} "
          f"{'peak growth MB':>14} {'held after MB':>13} {'step s':>7}")
    for r in rows:
        sub = f"{r['sub_group_bytes'] / mb:.1f}" if r["sub_group_bytes"] else "-"
        print(f"{r['mode']:5} {r['params']:>9} {r['state_bytes'] / mb:>9.1f} {sub:>12} "
              f"{r['buffers'] / mb:>10.1f} {r['peak_growth'] / mb:>14.1f} "
              f"{r['held_after'] / mb:>13.1f} {r['step_s']:>7.3f}")
    print(f"disk step / host step: {rows[1]['step_s'] / rows[0]['step_s']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
