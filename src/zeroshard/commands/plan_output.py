"""What ``zeroshard plan`` prints: the planner's figures for one configuration on one
layout, as tables (``plan/render.py``) or as one JSON object."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace

from ..plan import advice, render
from ..plan.arch import ModelSpec
from ..plan.comm import uses_zeropp, zeropp_dict
from ..plan.memory import STRATEGIES, generate_gather_bytes, plan_all
from ..plan.peak import peak
from ..plan.placement import disk_io_bytes, pcie_bytes
from ..spec.config import ZeroConfig
from ..spec.dims import ParallelDims
from . import plan_time
from .plan_checks import checkpointing_mode


@dataclass(frozen=True)
class Result:
    """Every figure of one ``zeroshard plan`` table, per strategy DDP first."""

    plans: list
    peaks: list
    moved: list
    """PCIe bytes a step (``offload.pcie_bytes``)."""
    disk_io: dict
    """``--offload-dir``: per offloaded strategy the bytes and seconds of disk I/O."""
    times: list | None
    fit: str | None
    mins: list | None
    sweep: dict | None


def _plain(config):
    """``config``'s precision alone: what the fit advice weighs (on the device, no ZeRO++)."""
    return replace(config, offload=None, offload_dir=None, secondary_group=None,
                   quantize_weights=False, quantize_grads=False)


def _disk_io(args, plans, model, dims) -> dict:
    """Per strategy on disk the bytes a step reads and writes, and their seconds at the
    host preset's ``disk_bandwidth``, one way at a time."""
    if not args.offload_dir:
        return {}
    bw = plan_time.cluster(args).host_side.disk_bandwidth
    io = {}
    for p in plans:
        if p.config.policy.optimizer_on_disk:
            moved = disk_io_bytes(model.params, dims, p.config)
            io[p.strategy] = {**moved, "seconds": (moved["read"] + moved["write"]) / bw,
                              "bandwidth": bw}
    return io


def compute(args, model, dims, config, work, budget, sweep) -> Result:
    """The planner's answers for ``config`` on ``dims`` (each stage at what it takes)."""
    blocks = args.blocks_per_unit
    plans = plan_all(model, dims, config, work, budget, blocks)
    # the peak's backward is modelled for full gradients; adapters (--lora) are not yet
    peaks = [None if model.trainable is not None else peak(model, dims, p.config, work, blocks)
             for p in plans]
    steps = plan_time.accumulation(args, work, dims.tp) if args.offload else 1
    moved = [pcie_bytes(model.params, dims, p.config, steps) for p in plans]
    times = plan_time.run_time(args, model, dims, config, work) if args.time else None
    mins = [advice.min_gpus(model, config.at_stage(s), budget, work, args.gpu_step)
            for s in range(len(STRATEGIES))] if args.min_gpus else None
    swept = ({n: plan_all(model, ParallelDims(n, dims.tp, dims.shard), config, work, budget,
                          blocks) for n in sweep} if sweep else None)
    return Result(plans, peaks, moved, _disk_io(args, plans, model, dims), times,
                  advice.first_fit(plans), mins, swept)


def json_out(args, model, dims, config, work, budget, shown, r: Result) -> None:
    out = {
        "model": model.name, "params": model.params, "gpus": args.gpus,
        "shard_group": dims.shard,
        "zeropp": zeropp_dict(config) if uses_zeropp(config) else None,
        "recipe": config.recipe.name, "tokens": work.tokens, "budget": budget,
        "first_fit": r.fit,
        "trainable": model.trainable,
        "strategies": [{**p.as_dict(), "peak": q and q.as_dict()}
                       for p, q in zip(r.plans, r.peaks) if p.strategy in shown],
        "generate_gather_bytes": generate_gather_bytes(model, dims, config.at_stage(3)),
    }
    if args.offload:
        out["offload"], out["gpus_per_node"] = args.offload, args.gpus_per_node
        out["offload_dir"] = args.offload_dir
        rows = iter(out["strategies"])
        for p, pc in zip(r.plans, r.moved):
            if p.strategy in shown:
                row = next(rows)
                row.update(host_per_node=p.host * args.gpus_per_node, pcie=pc)
                if p.strategy in r.disk_io:
                    row.update(disk_per_node=p.placement.disk_per_node(args.gpus_per_node),
                               disk_io=r.disk_io[p.strategy])
    if r.mins is not None:
        out["min_gpus"] = [m.as_dict() for m in r.mins if m.strategy in shown]
    if r.sweep is not None:
        out["sweep"] = {str(n): [p.as_dict() for p in ps if p.strategy in shown]
                        for n, ps in r.sweep.items()}
    if r.times is not None:
        out["time"] = [t.as_dict() for t in r.times if t.strategy in shown]
        if args.save_every or args.mtbf_hours:
            cost, text = _restarts(args, model, dims, config, r, shown)
            out["restarts"] = {**cost.as_dict(), "text": text}
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _restarts(args, model, dims, config, r: Result, shown):
    """What a failure costs (``--save-every`` / ``--mtbf-hours``): at the step time of
    the first strategy shown that fits, else the first shown; the checkpoint written by
    the K ranks of a shard group (``plan/failures.py``)."""
    st = next((t for t, p in zip(r.times, r.plans) if t.strategy in shown and p.fits),
              next(t for t in r.times if t.strategy in shown))
    return plan_time.restarts(args, model, config, st, dims.shard_size)


def _disk_line(args, plans, io, shown, config, unit) -> str:
    u = "GiB" if args.gib else "GB"
    parts = [f"{p.strategy} {p.placement.disk.total / unit:.2f} {u} per GPU, "
             f"{p.placement.disk_per_node(args.gpus_per_node) / unit:.2f} per node, "
             f"{io[p.strategy]['read'] / unit:.2f} read and written a step, "
             f"{io[p.strategy]['seconds']:.3f} s" for p in plans
             if p.strategy in shown and p.strategy in io]
    bw = next(iter(io.values()))["bandwidth"] if io else 0
    return (f"disk (--offload-dir, sub-groups of {config.sub_group_size:,} elements, "
            f"{bw / 1e9:g} GB/s per GPU, reads or writes): " + "; ".join(parts))


def text_out(args, model, dims, config, work, budget, shown, unit, r: Result) -> None:
    render.plan_table(model, config.recipe, work, args.gpus, budget, r.plans, shown, unit,
                      args.gib)
    if args.offload:
        render.offload_lines(r.plans, r.moved, shown, args.gpus_per_node, unit, args.gib)
        if args.offload_dir:
            render.line(_disk_line(args, r.plans, r.disk_io, shown, config, unit))
    if uses_zeropp(config):
        render.zeropp_line(config, r.plans, shown, unit, args.gib)
    if model.trainable is not None:
        render.line(f"trainable (LoRA adapters): {model.trainable:,} of {model.params:,} "
                    "parameters; the peak is not planned with adapters")
    else:
        render.line("peak per GPU (the largest of the loss's backward, a unit's backward "
                    "and the optimizer step): " + "; ".join(
                        f"{p.strategy} {render._fmt(q.bytes, unit)} at the {q.moment}"
                        for p, q in zip(r.plans, r.peaks) if p.strategy in shown))
    _generate_line(model, dims, config, r, shown, unit)
    if r.fit is None:
        plain = _plain(config)
        render.line(advice.why_none_fits(model, dims, plain, budget, work))
        offer = None if args.offload or dims.tp > 1 else advice.offload_offer(
            model, dims, plain, budget, work, args.gpus_per_node,
            plan_time.cluster(args).host_side, unit, "GiB" if args.gib else "GB")
        if offer:
            render.line(offer)
    else:
        render.line(f"first fit on {args.gpus} GPUs: {r.fit}")
    if r.mins is not None:
        render.min_gpus_table(r.mins, shown, budget, unit, args.gib, args.gpu_step)
    if r.sweep is not None:
        render.sweep_table(r.sweep, shown, unit, args.gib)
    if r.times is not None:
        render.time_table(r.times, r.plans, shown, args)
        if args.save_every or args.mtbf_hours:
            render.line(_restarts(args, model, dims, config, r, shown)[1])


def _generate_line(model, dims, config, r: Result, shown, unit) -> None:
    """At ZeRO-3, what ``model.generate()`` adds with the weights gathered once."""
    three = next((p for p in r.plans if p.strategy == "ZeRO-3"), None)
    if three is None or three.strategy not in shown:
        return
    extra = generate_gather_bytes(model, dims, config.at_stage(3))
    state = three.weights + three.grads + three.optimizer
    render.line(f"generate() at ZeRO-3 with the weights gathered once: +"
                f"{render._fmt(extra, unit)} per GPU beside the state's "
                f"{render._fmt(state, unit)} ({render._fmt(state + extra, unit)}, before the "
                "generation's activations); unit by unit where that does not fit")


def page_checkpointing(args) -> str:
    """The page's checkpointing for the flags': every k-th block is not one of its modes."""
    mode = checkpointing_mode(args)
    if isinstance(mode, int):
        raise ValueError(f"--html plans every block alike: drop --activation-checkpointing "
                         f"{mode} (or --checkpoint-every), or choose none, full, selective "
                         "or full+offload")
    return mode


def write_html(args, model: ModelSpec, config: ZeroConfig) -> None:
    """``--html``: the page, opening on these settings (data parallelism alone)."""
    from ..plan import page

    if (args.tp or 1) > 1:
        raise ValueError(f"--html plans data parallelism alone; drop --tp={args.tp}")
    page.write_page(args.html, model=args.model or model, gpus=args.gpus,
                    gpu_mem=args.gpu_mem, gib=args.gib, recipe=config.recipe,
                    tokens=args.tokens, seq_len=args.seq_len,
                    checkpointing=page_checkpointing(args),
                    flash_attention=args.flash_attention, gpu_step=args.gpu_step,
                    tp=args.tp or 1, shard_group=plan_time.shard_group(args))
    render.wrote(args.html)
    if uses_zeropp(config):
        sys.stderr.write("the page plans without hpZ and quantized collectives (it has "
                         "no control for them)\n")


def recommendation(args, model, config, budget, unit, rec) -> None:
    """``--recommend``'s answer, as a table with a reason per choice or as JSON."""
    if not args.json:
        render.recommendation(model, config.recipe, args, rec, unit, args.gib)
        return
    json.dump({"model": model.name, "params": model.params, "gpus": args.gpus,
               "offload": args.offload, "offload_dir": args.offload_dir,
               "gpus_per_node": args.gpus_per_node,
               "shard_group": plan_time.shard_group(args, per_tp=True),
               "recipe": config.recipe.name, "budget": budget,
               "accelerator": args.accelerator, "network": args.network,
               "recommend": rec.as_dict()}, sys.stdout, indent=2)
    sys.stdout.write("\n")
