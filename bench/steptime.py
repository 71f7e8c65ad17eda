"""The step-time model against measured step times on this machine's CPU.

    python bench/steptime.py --json docs/steptime.json   # GPT medium, N = 2, 12 steps each
    python bench/steptime.py --replay docs/steptime.json # predictions from a saved run

Measures the model's inputs here, one thread per process as the benchmark ranks run:

1. the GEMM rate: fp32 matmuls of the GPT medium preset's shapes (tokens × 384 times
   384 × 1152, 384 × 1536 and 1536 × 384), FLOP/s;
2. the efficiency: one process running the local micro-batch of an N = 2 step with no
   communication (bench/compare.py's "limit" row), its model FLOPs over its compute
   time (the step less the optimizer step) and over the GEMM rate;
3. the optimizer's streaming rate: AdamW steps over the model's parameters, as bytes
   the step-time model counts per parameter over the time;
4. gloo's latency α and bandwidth β: all-reduces of 4 kB to 32 MB at N = 2, fitted to the
   ring's 2(n-1)·α + 2(n-1)/n·T/β.

Then runs zeroshard stages 0-3 at N = 2 (bench/compare.py's ranks, the same global
batch and AdamW), predicts each step time from the measured inputs (the engine's own
copies at the optimizer's streaming rate) and prints predicted against measured, and
the ratio of each stage to stage 0 both ways.
``--replay`` recomputes the predictions from a saved run's measurements, with the
engine's overlap and with none (the transfers taking the compute cores), measuring
nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare import _rank  # noqa: E402  (bench/compare.py: one implementation per rank)


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_rate(tokens: int, hidden: int) -> float:
    """FLOP/s of the block's matmul shapes, one thread."""
    import torch

    torch.set_num_threads(1)
    x = torch.randn(tokens, hidden)
    h4 = torch.randn(tokens, 4 * hidden)
    weights = [(x, torch.randn(hidden, 3 * hidden)), (x, torch.randn(hidden, 4 * hidden)),
               (h4, torch.randn(4 * hidden, hidden))]
    flops = sum(2 * a.shape[0] * a.shape[1] * w.shape[1] for a, w in weights)
    return flops / _median_time(lambda: [a @ w for a, w in weights], 20)


def optimizer_rate(preset: str, streamed: int) -> tuple[float, float]:
    """(bytes/s as the model counts them, seconds) of AdamW over the model, one thread."""
    import torch

    from zeroshard.models.gpt import GPT, get_preset

    torch.set_num_threads(1)
    model = GPT(get_preset(preset))
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    seconds = _median_time(opt.step, 10)
    return sum(p.numel() for p in params) * streamed / seconds, seconds


def _all_reduce_times(sizes: list[int], repeats: int) -> list[float]:
    import torch
    import torch.distributed as dist

    out = []
    for n in sizes:
        buf = torch.zeros(n // 4)
        dist.all_reduce(buf)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out


def fit_alpha_beta(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """α and β of a ring all-reduce at n = 2, t = 2α + T/β: β from the two largest sizes
    (their difference cancels α), α from the smallest (where T/β is negligible)."""
    beta = (sizes[-1] - sizes[-2]) / (times[-1] - times[-2])
    return max(0.0, (times[0] - sizes[0] / beta) / 2), beta


def predict(run: dict, overlap: bool) -> list:
    """Step-time predictions of stages 0-3 from a run's measured inputs."""
    from zeroshard.models.gpt import GPT, get_preset
    from zeroshard.plan import ModelSpec, ParallelDims, Workload, ZeroConfig, get_recipe
    from zeroshard.plan.hardware import Accelerator, Cluster, Link, Network
    from zeroshard.plan.steptime import step_time

    args = run["args"]
    cfg = get_preset(args["preset"])
    params = sum(q.numel() for q in GPT(cfg).parameters())
    model = ModelSpec(args["preset"], params, cfg.hidden, cfg.layers, cfg.heads)
    work = Workload(args["batch"] // 2 * cfg.block_size, cfg.block_size, checkpointing=False)
    link = Link("gloo loopback", run["beta"], run["alpha"])
    cluster = Cluster(Accelerator("cpu", run["gemm_rate"], run["optimizer_rate"],
                                  run["efficiency"]),
                      Network("loopback", link, link, overlap, gloo=True), gpus_per_node=2)
    # compare.py trains in fp32 and reduces in fp32
    fp32 = ZeroConfig(mixed_precision=get_recipe("fp32-adamw"))
    return [step_time(model, ParallelDims(2), fp32.at_stage(stage), work, cluster)
            for stage in range(4)]


def report(measured: list[float], predicted: list) -> None:
    for stage, (m, q) in enumerate(zip(measured, predicted)):
        print(f"stage {stage}: measured {m * 1e3:7.1f} ms  predicted {q.step * 1e3:7.1f} ms  "
              f"error {(q.step / m - 1) * 100:+5.1f}%  (exposed comm {q.exposed * 1e3:.1f} ms, "
              f"optimizer {q.optimizer * 1e3:.1f} ms, copies {q.copies * 1e3:.1f} ms)")
    print("ratio to stage 0:  measured  predicted  error")
    for stage in range(1, 4):
        m, q = measured[stage] / measured[0], predicted[stage].step / predicted[0].step
        print(f"  stage {stage}            {m:.3f}     {q:.3f}   {(q / m - 1) * 100:+.1f}%")


def main() -> None:
    from zeroshard.models.gpt import GPT, get_preset
    from zeroshard.plan import ModelSpec, Workload, get_recipe
    from zeroshard.plan.steptime import train_flops_per_token
    from zeroshard.runtime.spawn import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="medium")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--replay", metavar="FILE", help="predict from a saved run; measure nothing")
    a = p.parse_args()
    if a.replay:
        with open(a.replay) as fh:
            run = json.load(fh)
        measured = [r["measured"] for r in run["stages"]]
        for overlap in (True, False):
            print(f"\n{'with the engine overlap' if overlap else 'with no overlap'}:")
            report(measured, predict(run, overlap))
        return
    n, lr = 2, 1e-3
    cfg = get_preset(a.preset)
    recipe = get_recipe("fp32-adamw")
    seq, local = cfg.block_size, a.batch // n
    work = Workload(local * seq, seq, checkpointing=False)

    rate = gemm_rate(local * seq, cfg.hidden)
    streamed = 2 * (recipe.optimizer_bytes + recipe.weight_bytes) + recipe.grad_bytes
    opt_bw, opt_s = optimizer_rate(a.preset, streamed)
    sizes = [4096, 1 << 20, 4 << 20, 16 << 20, 32 << 20]
    ar = spawn(_all_reduce_times, n, sizes, 7, timeout=300)[0]
    alpha, beta = fit_alpha_beta(sizes, ar)
    limit = spawn(_rank, 1, "limit", a.preset, a.steps, a.batch, lr, n, timeout=900)[0]
    params = sum(q.numel() for q in GPT(cfg).parameters())
    model = ModelSpec(a.preset, params, cfg.hidden, cfg.layers, cfg.heads)
    flops = train_flops_per_token(model, seq, False) * work.tokens
    efficiency = min(1.0, flops / (limit["median"] - opt_s) / rate)
    print(f"GEMM rate {rate / 1e9:.1f} GFLOP/s; one-process step {limit['median'] * 1e3:.1f} ms "
          f"(optimizer {opt_s * 1e3:.1f} ms) -> efficiency {efficiency:.3f}; AdamW streams "
          f"{opt_bw / 1e9:.2f} GB/s; gloo alpha {alpha * 1e6:.0f} us, beta {beta / 1e9:.2f} GB/s",
          flush=True)
    print("all-reduce ms: " + ", ".join(f"{s >> 10} KiB {t * 1e3:.2f}" for s, t in zip(sizes, ar)))
    run = {"args": vars(a), "gemm_rate": rate, "efficiency": efficiency,
           "optimizer_rate": opt_bw, "alpha": alpha, "beta": beta,
           "all_reduce": dict(zip(map(str, sizes), ar)), "limit": limit}
    measured, iqrs = [], []
    for stage in range(4):
        r = spawn(_rank, n, f"zeroshard-{stage}", a.preset, a.steps, a.batch, lr, n,
                  timeout=900)[0]
        measured.append(r["median"])
        iqrs.append(r["iqr"])
        print(f"stage {stage}: measured {r['median'] * 1e3:7.1f} ms (IQR {r['iqr'] * 1e3:5.1f})",
              flush=True)
    predicted = predict(run, overlap=True)
    report(measured, predicted)
    run["stages"] = [{"stage": k, "measured": m, "iqr": iqr, "predicted": q.step,
                      "exposed": q.exposed, "optimizer": q.optimizer, "copies": q.copies}
                     for k, (m, iqr, q) in enumerate(zip(measured, iqrs, predicted))]
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(run, fh, indent=1)


if __name__ == "__main__":
    main()
