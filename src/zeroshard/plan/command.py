"""zeroshard plan — which ZeRO stage fits, and what it costs on the wire.

Memory per GPU by category (weights, gradients, optimizer state, activations) for
DDP and ZeRO-1/2/3, communication per GPU per step, and the first strategy that fits.
Figures are decimal GB (1e9 bytes) unless --gib is given.

examples:
  zeroshard plan --model llama2-7b --gpus 8
  zeroshard plan --params 6738149376 --hidden 4096 --layers 32 --gpu-mem 24
  zeroshard plan --model llama2-70b --min-gpus
  zeroshard plan --hf-config path/to/config.json --sweep 8,16,32,64 --json
  zeroshard plan --model llama2-70b --gpus 64 --html plan.html
  zeroshard plan --model llama2-13b --gpus 64 --time --global-batch 1024
  zeroshard plan --model llama2-70b --gpus 64 --network pcie4-roce --recommend
  zeroshard plan --model llama2-13b --gpus 64 --shard-group node --time
  zeroshard plan --model llama2-70b --gpus 8 --offload optimizer --time
  zeroshard plan --model llama2-70b --gpus 8 --offload optimizer --offload-dir --time
  zeroshard plan --model llama2-70b --gpus 64 --hpz 8 --quantize-weights --quantize-grads
"""

from __future__ import annotations

import argparse
import json
import sys

from .._paths import output_file
from ..spec.recipes import DEFAULT_RECIPE, RECIPES, get_recipe
from . import advice, render, timecmd
from .arch import PRESETS, Architecture, ModelSpec, get_preset
from .hfconfig import KINDS, from_hf_config
from .memory import QUANT_BLOCK, STRATEGIES, Workload, ZeroPP, plan_all, shard_degree, stage_of
from .offload import OFFLOADS, SUB_GROUP_SIZE, disk_io_bytes, pcie_bytes
from .peak import peak

_DIM_FLAGS = ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab")


def _restarts(args, model, recipe, times, plans, shown, tp, group):
    """The restart cost of the first strategy shown that fits (else the first shown)."""
    st = next((t for t, p in zip(times, plans) if t.strategy in shown and p.fits),
              next(t for t in times if t.strategy in shown))
    return timecmd.restarts(args, model, recipe, st, group or args.gpus // tp)


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model (one of --model, --hf-config, --params, or dimensions)")
    m.add_argument("--model", metavar="NAME",
                   help="a preset (see --list-models); the default is llama2-7b")
    m.add_argument("--list-models", action="store_true", help="list the presets and exit")
    m.add_argument("--hf-config", metavar="PATH",
                   help=f"a Hugging Face config.json ({', '.join(KINDS)})")
    m.add_argument("--params", type=int, metavar="N",
                   help="a bare parameter count; give --hidden and --layers to model activations")
    m.add_argument("--hidden", type=int, help="model width h")
    m.add_argument("--layers", type=int, help="transformer blocks L")
    m.add_argument("--heads", type=int, help="attention heads")
    m.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention)")
    m.add_argument("--ffn", type=int, help="MLP inner width (a llama-style gated MLP)")
    m.add_argument("--vocab", type=int, help="vocabulary size")
    m.add_argument("--tied", action="store_true", help="the output head shares the embedding")

    h = p.add_argument_group("hardware and recipe")
    h.add_argument("--gpus", type=int, default=8,
                   help="GPUs N (default 8); ZeRO shards over N / --tp of them")
    h.add_argument("--gpu-mem", type=float, default=80.0,
                   help="memory per GPU in GB (GiB with --gib); default 80")
    h.add_argument("--shard-group", metavar="K|node",
                   help="hybrid sharding: shard over groups of K data-parallel ranks and "
                        "replicate across the N / K groups; 'node': --gpus-per-node / --tp "
                        "(default: plain, over all N); bytes are split inside/across groups")
    h.add_argument("--gib", action="store_true", help="every figure in GiB instead of GB")
    h.add_argument("--precision", default=DEFAULT_RECIPE, metavar="RECIPE",
                   help=f"one of {', '.join(RECIPES)}, or custom bytes W/G/O "
                        f"(default {DEFAULT_RECIPE})")
    h.add_argument("--reduce-dtype", choices=("fp32", "bf16", "fp16"),
                   help="dtype gradients travel in (default: the recipe's gradient dtype)")
    h.add_argument("--offload", choices=OFFLOADS,
                   help="keep the master and optimizer state in host memory (stages 1-3), "
                        "'params' the weight shards too (stage 3; ZeRO-1/2 then offload the "
                        "optimizer only, DDP nothing): device and host bytes, host memory per "
                        "node, PCIe bytes per step")
    h.add_argument("--offload-dir", action="store_true",
                   help="with --offload (or --recommend, which offloads only when nothing "
                        "fits): the master and optimizer state in files (the engine's "
                        "offload_dir, DeepSpeed's nvme): device, host (the fp32 gradients and "
                        "the step's sub-group buffers) and disk bytes per GPU, disk per node, "
                        "disk bytes and seconds per step, in the peak, --time and --recommend")
    h.add_argument("--sub-group-size", type=int, metavar="G",
                   help="with --offload-dir: elements stepped at once (the engine's "
                        f"sub_group_size, default {SUB_GROUP_SIZE:.0e})")

    z = p.add_argument_group("ZeRO++ (the engine's secondary_group, quantize_weights, "
                             "quantize_grads; each strategy takes what it can)")
    z.add_argument("--hpz", type=int, metavar="K2",
                   help="hpZ (stage 3): after a unit's forward keep K/K2 of its weights' slots "
                        "so that its backward gathers over K2 ranks (a secondary group, "
                        "dividing the shard group): weights/K2 more memory until backward, "
                        "bytes at the 'secondary' level")
    z.add_argument("--quantize-weights", action="store_true",
                   help="qwZ (stage 3): the weights' all-gathers send int8 blocks with one fp32 "
                        "scale each (backward's too, unless --hpz keeps them)")
    z.add_argument("--quantize-grads", action="store_true",
                   help="qgZ (stages 1-3): the gradients' reduce-scatter sends int8 blocks; the "
                        "all-reduce across shard groups stays exact (not with --reduce-dtype)")
    z.add_argument("--quant-block", type=int, default=QUANT_BLOCK, metavar="B",
                   help=f"elements per quantization block, one fp32 scale each (default "
                        f"{QUANT_BLOCK})")

    a = p.add_argument_group("activations")
    a.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch (default 2048)")
    a.add_argument("--seq-len", type=int, help="sequence length for the attention term "
                                               "(default: --tokens)")
    a.add_argument("--no-checkpointing", action="store_true",
                   help="no activation checkpointing: every block keeps its activations")
    a.add_argument("--checkpoint-every", type=int, metavar="K",
                   help="checkpoint every K-th block only (torchtitan's selective "
                        "checkpointing by layer; default 1: every block)")
    a.add_argument("--flash-attention", action="store_true",
                   help="a flash kernel: the s×s attention probabilities are never stored, "
                        "in the forward or in a checkpointed block's recompute")

    o = p.add_argument_group("output")
    o.add_argument("--strategy", help="show one strategy: DDP, ZeRO-1, ZeRO-2 or ZeRO-3")
    o.add_argument("--min-gpus", action="store_true",
                   help="the fewest GPUs at which each strategy fits --gpu-mem")
    o.add_argument("--gpu-step", type=int, metavar="K",
                   help="with --min-gpus: search 1 and multiples of K (8 = whole nodes) "
                        "instead of powers of two")
    o.add_argument("--sweep", metavar="N,N,...", help="the table over these GPU counts")
    o.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    o.add_argument("--html", metavar="FILE.html",
                   help="also write the planner as one self-contained page (opens from disk, "
                        "no network) that starts from these settings")
    o.add_argument("--plot", metavar="FILE.png",
                   help="stacked bars per strategy with the budget line")
    timecmd.add_arguments(p)


def resolve_model(args) -> ModelSpec:
    """The model from exactly one source; contradictory flags are an error."""
    dims = [f for f in _DIM_FLAGS if getattr(args, f) is not None] + (["tied"] if args.tied else [])
    flag = lambda f: "--" + f.replace("_", "-")  # noqa: E731
    if args.model and args.hf_config:
        raise ValueError("--model and --hf-config contradict each other; give one")
    for source in ("model", "hf_config"):
        if getattr(args, source) and (dims or args.params is not None):
            other = "--params" if args.params is not None else flag(dims[0])
            raise ValueError(f"{flag(source)} and {other} contradict each other; give one")
    if args.model:
        return ModelSpec.from_arch(get_preset(args.model))
    if args.hf_config:
        return ModelSpec.from_arch(from_hf_config(args.hf_config))
    if args.params is not None:
        extra = [d for d in dims if d not in ("hidden", "layers", "heads")]
        if extra:
            raise ValueError(f"{flag(extra[0])} has no effect with --params (the count is given)")
        return ModelSpec("custom", args.params, args.hidden, args.layers,
                         args.heads)
    if dims:
        missing = [flag(f) for f in ("hidden", "layers", "heads", "ffn", "vocab")
                   if getattr(args, f) is None]
        if missing:
            raise ValueError(f"model dimensions are incomplete: missing {', '.join(missing)}")
        return ModelSpec.from_arch(Architecture(
            "custom", args.hidden, args.layers, args.heads, args.ffn, args.vocab,
            kv_heads=args.kv_heads, tied=args.tied))
    return ModelSpec.from_arch(PRESETS["llama2-7b"])


def check_disk(args) -> None:
    """``--offload-dir`` needs an offload to put on disk (``--offload``, or
    ``--recommend``'s when nothing fits); ``--sub-group-size`` needs ``--offload-dir``."""
    if args.offload_dir and not (args.offload or args.recommend):
        raise ValueError("--offload-dir keeps the offloaded optimizer state on disk: add "
                         "--offload optimizer (or params), or --recommend (which offloads "
                         "only when nothing fits)")
    if args.sub_group_size is not None and not args.offload_dir:
        raise ValueError(f"--sub-group-size={args.sub_group_size} sizes disk offload's "
                         "step: add --offload-dir")
    _positive("sub-group-size", args.sub_group_size)


def _disk_io(args, plans, model, recipe, tp, group) -> dict:
    """``--offload-dir``: per offloaded strategy the disk bytes a step reads and writes,
    and their seconds at the host preset's ``disk_bandwidth``, one way at a time."""
    if not args.offload_dir:
        return {}
    bw = timecmd.cluster(args).host_side.disk_bandwidth
    io = {}
    for p in plans:
        if p.offload:
            moved = disk_io_bytes(model.params, args.gpus, recipe, stage_of(p.strategy),
                                  p.offload, tp, group)
            io[p.strategy] = {**moved, "seconds": (moved["read"] + moved["write"]) / bw,
                              "bandwidth": bw}
    return io


def _disk_line(plans, io, shown, args, unit) -> str:
    u = "GiB" if args.gib else "GB"
    parts = [f"{p.strategy} {p.placement.disk.total / unit:.2f} {u} per GPU, "
             f"{p.placement.disk_per_node(args.gpus_per_node) / unit:.2f} per node, "
             f"{io[p.strategy]['read'] / unit:.2f} read and written a step, "
             f"{io[p.strategy]['seconds']:.3f} s" for p in plans
             if p.strategy in shown and p.strategy in io]
    bw = next(iter(io.values()))["bandwidth"] if io else 0
    return (f"disk (--offload-dir, sub-groups of {timecmd.sub_group_size(args):,} elements, "
            f"{bw / 1e9:g} GB/s per GPU, reads or writes): " + "; ".join(parts))


def _positive(name: str, value) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"--{name}={value} must be positive")


def _writable(flag: str, path: str | None) -> None:
    """An output file's folder must exist and take writes: found before any work."""
    if path is not None:
        output_file(f"--{flag}", path)


def _sweep(spec: str) -> list[int]:
    try:
        counts = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"--sweep={spec!r} must be comma-separated GPU counts, e.g. 8,16,32") from None
    if not counts or any(n <= 0 for n in counts):
        raise ValueError(f"--sweep={spec!r} must list positive GPU counts, e.g. 8,16,32")
    return counts


def zeropp(args, stage: int | None = None) -> ZeroPP | None:
    """ZeRO++ from ``--hpz``, ``--quantize-weights``, ``--quantize-grads`` and
    ``--quant-block`` (None when none is given), refused in the engine's words where the
    recipe (an explicit ``--reduce-dtype``) or the one strategy asked for cannot take it."""
    hpz, qw, qg = args.hpz, args.quantize_weights, args.quantize_grads
    if hpz is None and not qw and not qg:
        if args.quant_block != QUANT_BLOCK:
            raise ValueError(f"--quant-block={args.quant_block} needs --quantize-weights or "
                             "--quantize-grads")
        return None
    z = ZeroPP(hpz, qw, qg, args.quant_block)
    if qg:  # an explicit --reduce-dtype, at any stage
        ZeroPP(quantize_grads=True).check(1, get_recipe(args.precision).with_reduce_dtype(
            args.reduce_dtype))
    if stage is not None:
        z.check(stage)
    return z


def run(args) -> int:
    if args.list_models:
        render.models(PRESETS)
        return 0
    for name in ("gpus", "gpu_mem", "tokens", "seq_len", "params", "checkpoint_every",
                 *_DIM_FLAGS):
        _positive(name.replace("_", "-"), getattr(args, name))
    if args.checkpoint_every is not None and args.no_checkpointing:
        raise ValueError("--checkpoint-every and --no-checkpointing contradict each other")
    timecmd.check(args)
    check_disk(args)
    _writable("html", args.html)
    _writable("plot", args.plot)
    model = resolve_model(args)
    recipe = get_recipe(args.precision)
    if args.reduce_dtype:
        recipe = recipe.with_reduce_dtype(args.reduce_dtype)
    work = Workload(args.tokens, args.seq_len, not args.no_checkpointing, args.flash_attention,
                    args.checkpoint_every or 1)
    unit = 2**30 if args.gib else 10**9
    budget = int(args.gpu_mem * unit)
    shown = [STRATEGIES[stage_of(args.strategy)]] if args.strategy else list(STRATEGIES)
    sweep = _sweep(args.sweep) if args.sweep else None
    zpp = zeropp(args, stage_of(args.strategy) if args.strategy else None)
    if zpp is not None and args.recommend:
        raise ValueError("--recommend does not weigh hpZ or quantized collectives yet; drop "
                         "--hpz, --quantize-weights and --quantize-grads (or plan them without "
                         "--recommend, with --time)")
    if zpp is not None and zpp.secondary_group is not None and args.min_gpus:
        raise ValueError(f"--min-gpus searches GPU counts for plain ZeRO-3; --hpz="
                         f"{args.hpz} adds weights/{args.hpz} per GPU until backward: drop one")

    if args.html:
        from . import page

        if (args.tp or 1) > 1:
            raise ValueError(f"--html plans data parallelism alone; drop --tp={args.tp}")

        page.write_page(args.html, model=args.model or model, gpus=args.gpus,
                        gpu_mem=args.gpu_mem, gib=args.gib, recipe=recipe, tokens=args.tokens,
                        seq_len=args.seq_len, checkpointing=not args.no_checkpointing,
                        flash_attention=args.flash_attention, gpu_step=args.gpu_step,
                        tp=args.tp or 1, shard_group=timecmd.shard_group(args))
        render.wrote(args.html)
        if zpp is not None:
            sys.stderr.write("the page plans without hpZ and quantized collectives (it has "
                             "no control for them)\n")
    if args.recommend:
        rec = timecmd.run_recommend(args, model, recipe, budget)
        if args.json:
            json.dump({"model": model.name, "params": model.params, "gpus": args.gpus,
                       "offload": args.offload, "offload_dir": args.offload_dir,
                       "gpus_per_node": args.gpus_per_node,
                       "shard_group": timecmd.shard_group(args, per_tp=True),
                       "recipe": recipe.name, "budget": budget, "accelerator": args.accelerator,
                       "network": args.network, "recommend": rec.as_dict()}, sys.stdout,
                      indent=2)
            sys.stdout.write("\n")
        else:
            render.recommendation(model, recipe, args, rec, unit, args.gib)
        return 0
    tp = args.tp or 1
    if tp > 1 and args.min_gpus:
        raise ValueError(f"--min-gpus searches data-parallel GPU counts only; drop --tp={tp}")
    group = timecmd.shard_group(args)
    if group is not None and args.min_gpus:
        raise ValueError("--min-gpus searches GPU counts for plain sharding; under "
                         f"--shard-group={args.shard_group} memory depends on the group alone")
    if args.offload and (args.min_gpus or args.sweep):
        raise ValueError(f"--offload={args.offload} plans one GPU count; drop "
                         f"{'--min-gpus' if args.min_gpus else '--sweep'}")
    if zpp is not None:
        zpp.secondary(shard_degree(args.gpus, tp, group))  # K2 must divide the shard group
    sub = timecmd.sub_group_size(args)
    plans = plan_all(model, args.gpus, recipe, work, budget, tp, group, args.offload, zpp,
                     args.blocks_per_unit, args.offload_dir, sub)
    disk_io = _disk_io(args, plans, model, recipe, tp, group)
    prefetch = 1 if args.prefetch is None else args.prefetch
    peaks = [peak(model, recipe, work, args.gpus, s, prefetch, args.blocks_per_unit, tp,
                  shard_group=group, offload=args.offload, zeropp=zpp,
                  offload_dir=args.offload_dir, sub_group_size=sub) for s in range(4)]
    steps = timecmd.accumulation(args, work, tp) if args.offload else 1
    moved = [pcie_bytes(model.params, args.gpus, recipe, s, p.offload, tp, group, steps)
             for s, p in enumerate(plans)]
    times = timecmd.run_time(args, model, recipe, work, zpp) if args.time else None
    fit = advice.first_fit(plans)
    if args.gpu_step is not None and not args.min_gpus:
        raise ValueError("--gpu-step only applies with --min-gpus")
    _positive("gpu-step", args.gpu_step)
    mins = [advice.min_gpus(model, recipe, s, budget, work, args.gpu_step)
            for s in STRATEGIES] if args.min_gpus else None
    sweep_plans = ({n: plan_all(model, n, recipe, work, budget, tp, group, None, zpp,
                                args.blocks_per_unit) for n in sweep} if sweep else None)

    if args.json:
        out = {
            "model": model.name, "params": model.params, "gpus": args.gpus,
            "shard_group": group, "zeropp": None if zpp is None else zpp.as_dict(),
            "recipe": recipe.name, "tokens": work.tokens, "budget": budget,
            "first_fit": fit,
            "strategies": [{**p.as_dict(), "peak": q.as_dict()}
                           for p, q in zip(plans, peaks) if p.strategy in shown],
        }
        if args.offload:
            out["offload"], out["gpus_per_node"] = args.offload, args.gpus_per_node
            out["offload_dir"] = args.offload_dir
            rows = iter(out["strategies"])
            for p, pc in zip(plans, moved):
                if p.strategy in shown:
                    row = next(rows)
                    row.update(host_per_node=p.host * args.gpus_per_node, pcie=pc)
                    if args.offload_dir and p.offload:
                        row.update(disk_per_node=p.placement.disk_per_node(args.gpus_per_node),
                                   disk_io=disk_io[p.strategy])
        if mins is not None:
            out["min_gpus"] = [m.as_dict() for m in mins if m.strategy in shown]
        if sweep_plans is not None:
            out["sweep"] = {str(n): [p.as_dict() for p in ps if p.strategy in shown]
                            for n, ps in sweep_plans.items()}
        if times is not None:
            out["time"] = [t.as_dict() for t in times if t.strategy in shown]
            if args.save_every or args.mtbf_hours:
                cost, text = _restarts(args, model, recipe, times, plans, shown, tp, group)
                out["restarts"] = {**cost.as_dict(), "text": text}
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render.plan_table(model, recipe, work, args.gpus, budget, plans, shown, unit, args.gib)
        if args.offload:
            render.offload_lines(plans, moved, shown, args.gpus_per_node, unit, args.gib)
            if args.offload_dir:
                render.line(_disk_line(plans, disk_io, shown, args, unit))
        if zpp is not None:
            render.zeropp_line(zpp, plans, shown, unit, args.gib)
        render.line("peak per GPU (the largest of the loss's backward, a unit's backward "
                    "and the optimizer step): " + "; ".join(
                        f"{p.strategy} {q.bytes / unit:.2f} at the {q.moment}"
                        for p, q in zip(plans, peaks) if p.strategy in shown))
        if fit is None:
            render.line(advice.why_none_fits(model, recipe, args.gpus, budget, work, group))
            offer = None if args.offload or tp > 1 else advice.offload_offer(
                model, recipe, args.gpus, budget, work, group, args.gpus_per_node,
                timecmd.cluster(args).host_side, unit, "GiB" if args.gib else "GB")
            if offer:
                render.line(offer)
        else:
            render.line(f"first fit on {args.gpus} GPUs: {fit}")
        if mins is not None:
            render.min_gpus_table(mins, shown, budget, unit, args.gib, args.gpu_step)
        if sweep_plans is not None:
            render.sweep_table(sweep_plans, shown, unit, args.gib)
        if times is not None:
            render.time_table(times, plans, shown, args)
            if args.save_every or args.mtbf_hours:
                render.line(_restarts(args, model, recipe, times, plans, shown, tp, group)[1])
    if args.plot:
        render.plot(args.plot, model, recipe, args.gpus, budget, plans, shown, unit, args.gib)
    return 0
