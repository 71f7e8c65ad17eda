"""Tables and charts for the planner (rich and matplotlib; never torch)."""

from __future__ import annotations

import shutil
import sys

from rich.console import Console
from rich.table import Table


def _console() -> Console:
    # Wide enough for the plan table even when stdout is a pipe.
    return Console(width=max(shutil.get_terminal_size((120, 24)).columns, 110), highlight=False)


#: From this many units on (a billion GB) a figure is written in powers of ten, so that
#: a table column keeps it whole (format.js's ``bytes`` does the same).
HUGE = 1e9


def _fmt(value: int | None, unit: int, decimals: int = 2) -> str:
    if value is None:
        return "n/a"
    x = value / unit
    return f"{x:.{decimals}e}" if abs(x) >= HUGE else f"{x:.{decimals}f}"


def line(text: str) -> None:
    _console().print(text)


def models(presets) -> None:
    t = Table(title="model presets")
    for col in ("name", "params", "hidden", "layers", "heads", "kv heads", "ffn", "vocab", "tied"):
        t.add_column(col, justify="left" if col == "name" else "right")
    for a in presets.values():
        t.add_row(a.name, f"{a.params:,}", str(a.hidden), str(a.layers), str(a.heads),
                  str(a.kv_heads or a.heads), str(a.ffn), str(a.vocab), "yes" if a.tied else "no")
    _console().print(t)


def checkpointing_words(work) -> str:
    """"checkpointing full", "checkpointing every 2nd block", "no checkpointing"."""
    mode = work.mode
    if mode == "none":
        return "no checkpointing"
    if isinstance(mode, int):
        return f"checkpointing every {ordinal(mode)} block"
    return f"checkpointing {mode}"


def ordinal(k: int) -> str:
    """2nd, 3rd, 11th, 21st."""
    end = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{end}"


def plan_table(model, recipe, work, gpus, budget, plans, shown, unit, gib) -> None:
    u = "GiB" if gib else "GB"
    act = checkpointing_words(work) + (", flash attention" if work.flash_attention else "")
    title = (f"{model.name} (P = {model.params:,}), N = {gpus} GPUs, {recipe.name} "
             f"({recipe.total_bytes} bytes/param), {work.tokens:,} tokens, {act}")
    if plans[0].tp > 1:
        title += f", TP = {plans[0].tp} (ZeRO over {gpus // plans[0].tp} ranks)"
    k = plans[0].shard_group
    if k is not None:
        title += f", {hybrid_title(k, gpus // plans[0].tp)}"
    hpz = any(p.secondary for p in plans)
    levels = ([f"inside {u}"] if k is not None or hpz else []) + (
        [f"across {u}"] if k is not None else []) + ([f"secondary {u}"] if hpz else [])
    kept = [f"hpZ {u}"] if hpz else []
    offload = any(p.offload for p in plans)
    hosted = ["offload", f"host {u}"] if offload else []
    if offload:
        title += "; weights, grads, optim and total on the GPU"
    t = Table(title=title, title_justify="left")
    for col in ("strategy", *hosted, "weights", "grads", "optim", "activ", *kept,
                f"total {u}", f"comm {u}", *levels, "vs DDP", f"fits {budget / unit:g} {u}"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    ddp_comm = plans[0].comm
    for p in plans:
        if p.strategy not in shown:
            continue
        ratio = f"{p.comm / ddp_comm:.2f}x" if ddp_comm else "n/a"
        took = p.secondary > 0  # the hpZ this strategy takes keeps secondary shards
        split = ([_fmt(p.comm_inside, unit)] if levels else []) + (
            [_fmt(p.comm_across, unit)] if k is not None else []) + (
            [_fmt(p.comm_secondary, unit) if took else "-"] if hpz else [])
        host = [p.offload or "-", _fmt(p.host, unit)] if offload else []
        t.add_row(p.strategy, *host, _fmt(p.weights, unit), _fmt(p.grads, unit),
                  _fmt(p.optimizer, unit), _fmt(p.activations, unit, 3),
                  *([_fmt(p.secondary, unit) if took else "-"] if hpz else []),
                  _fmt(p.total, unit),
                  _fmt(p.comm, unit),
                  *split, ratio, "yes" if p.fits else "no")
    _console().print(t)
    if plans[0].activations is None:
        line("activations: not modelled (give --hidden and --layers)")
    if plans[0].tp > 1:
        line(f"TP collectives (its all-reduces, and a vocabulary-parallel head's all-gather): "
             f"{_fmt(plans[0].tp_comm, unit)} {u} per GPU per micro-batch, the ledger's 'tp' "
             "level (beside the comm column)")


def offload_lines(plans, moved, shown, gpus_per_node, unit, gib) -> None:
    """Offload: per strategy, host memory per GPU and per node, and PCIe bytes a step."""
    u = "GiB" if gib else "GB"
    parts = [f"{p.strategy} {p.host / unit:.2f} {u} per GPU, "
             f"{p.host * gpus_per_node / unit:.2f} per node, {m['down'] / unit:.2f} down "
             f"and {m['up'] / unit:.2f} up" for p, m in zip(plans, moved)
             if p.strategy in shown and p.offload]
    if parts:
        line(f"host memory and PCIe bytes per step (nodes of {gpus_per_node} GPUs, "
             "--gpus-per-node): " + "; ".join(parts))


def zeropp_line(z, plans, shown, unit, gib) -> None:
    """ZeRO++ of the ``ZeroConfig`` ``z``: what each strategy took (``p.config``, its
    stage's share; the engine refuses the rest at that stage)."""
    u = "GiB" if gib else "GB"
    parts = []
    for p in plans:
        if p.strategy not in shown:
            continue
        took = p.config
        names = ([f"hpZ in groups of {took.secondary_group} ({p.secondary / unit:.2f} {u} "
                  f"kept from forward to backward, {p.comm_secondary / unit:.2f} {u} of "
                  "backward gathers inside them)"] if p.secondary else []) + (
            (["qwZ"] if took.quantize_weights else [])
            + (["qgZ"] if took.quantize_grads else []))
        parts.append(f"{p.strategy} {', '.join(names) if names else 'none'}")
    block = (f"; int8 in blocks of {z.quant_block} with one fp32 scale each"
             if z.quantize_weights or z.quantize_grads else "")
    line("ZeRO++ (hpZ and qwZ at stage 3, qgZ at stages 1-3, as the engine takes them): "
         + "; ".join(parts) + block)


def hybrid_title(k: int, dp: int) -> str:
    """'shard groups of 8 (8 replicas)': hybrid sharding's two levels in a title."""
    return f"shard groups of {k} ({dp // k} replica{'s' if dp // k > 1 else ''})"


def min_gpus_table(mins, shown, budget, unit, gib, step) -> None:
    u = "GiB" if gib else "GB"
    counts = "powers of two" if step is None else f"1 or multiples of {step}"
    t = Table(title=f"fewest GPUs that fit {budget / unit:g} {u} ({counts})", title_justify="left")
    for col in ("strategy", "GPUs", f"per GPU {u}", f"state floor {u}"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for m in mins:
        if m.strategy in shown:
            gpus = "never" if m.gpus is None else str(m.gpus)
            t.add_row(m.strategy, gpus, _fmt(m.total, unit), _fmt(m.floor, unit, 1))
    _console().print(t)


def sweep_table(sweep_plans, shown, unit, gib) -> None:
    u = "GiB" if gib else "GB"
    t = Table(title=f"total per GPU ({u}) over GPU counts", title_justify="left")
    t.add_column("GPUs", justify="right")
    for s in shown:
        t.add_column(s, justify="right")
    for n, plans in sweep_plans.items():
        by = {p.strategy: p for p in plans}
        t.add_row(str(n), *(_fmt(by[s].total, unit) + ("" if by[s].fits else " ✗") for s in shown))
    _console().print(t)


def plot(path, model, recipe, gpus, budget, plans, shown, unit, gib) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    u = "GiB" if gib else "GB"
    rows = [p for p in plans if p.strategy in shown]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    bottom = [0.0] * len(rows)
    names = [p.strategy for p in rows]
    for cat, color in (("weights", "#4C72B0"), ("grads", "#DD8452"), ("optimizer", "#55A868"),
                       ("activations", "#C44E52")):
        vals = [(getattr(p, cat) or 0) / unit for p in rows]
        bars = ax.bar(names, vals, bottom=bottom, label=cat, color=color)
        for bar, v, b in zip(bars, vals, bottom):
            if v > 0.06 * max(p.total / unit for p in rows):
                ax.text(bar.get_x() + bar.get_width() / 2, b + v / 2, f"{cat}\n{v:.1f}",
                        ha="center", va="center", fontsize=7, color="white")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(budget / unit, color="black", linestyle="--", linewidth=1)
    ax.text(len(rows) - 0.5, budget / unit, f" budget {budget / unit:g} {u}", va="bottom",
            ha="right", fontsize=8)
    ax.set_ylabel(f"{u} per GPU")
    ax.set_title(f"{model.name}, {gpus} GPUs, {recipe.name}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    wrote(path)


def wrote(path: str) -> None:
    """Say a file was written, on stderr (stdout may be --json), for every output file."""
    sys.stderr.write(f"wrote {path}\n")


def time_table(times, plans, shown, args) -> None:
    """Predicted seconds per step and where they go, one row per strategy."""
    prefetch = 1 if args.prefetch is None else args.prefetch
    k = plans[0].shard_group
    group = f", {hybrid_title(k, args.gpus // plans[0].tp)}" if k is not None else ""
    t = Table(title=(f"step time on {args.gpus} x {args.accelerator} ({args.network}, "
                     f"{args.gpus_per_node} per node){group}, {args.blocks_per_unit} block(s) "
                     f"per unit, prefetch {prefetch}"), title_justify="left")
    across = ["across s"] if k is not None else []
    second = ["secondary s"] if any(st.secondary for st in times) else []
    pcie = ["PCIe s"] if any(st.pcie for st in times) else []
    # disk offload: the drive's read and write seconds, and what they add to the host step
    disk = ["disk s", "disk wait s"] if any(st.disk for st in times) else []
    for col in ("strategy", "step s", "compute s", "TP s", "optimizer s", "copies s",
                *pcie, *disk, "comm s", *across, *second, "exposed s", "tokens/s/GPU",
                "fits"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for st, p in zip(times, plans):
        if st.strategy in shown:
            t.add_row(st.strategy, f"{st.step:.3f}", f"{st.compute:.3f}", f"{st.tp_comm:.3f}",
                      f"{st.optimizer:.4f}", f"{st.copies:.4f}",
                      *([f"{st.pcie:.3f}"] if pcie else []),
                      *([f"{st.disk:.3f}", f"{st.disk_wait:.3f}"] if disk else []),
                      f"{st.comm:.3f}",
                      *([f"{st.across:.3f}"] if across else []),
                      *([f"{st.secondary:.3f}"] if second else []), f"{st.exposed:.3f}",
                      f"{st.tokens_per_gpu:,.0f}", "yes" if p.fits else "no")
    _console().print(t)


def _config_row(c, best, unit) -> list[str]:
    return [c.strategy, str(c.tp), "all" if c.shard_group is None else str(c.shard_group),
            str(c.blocks_per_unit),
            str(c.prefetch) if c.policy.shards_params else "-",
            c.checkpointing,
            f"{c.micro_batch} x {c.accumulation}", _fmt(c.memory, unit), f"{c.time.step:.3f}",
            f"{c.time.tokens_per_gpu:,.0f}", f"{c.time.exposed:.3f}",
            "best" if c is best else f"{(c.time.step / best.time.step - 1) * 100:+.1f}%"]


def recommendation(model, recipe, args, rec, unit, gib) -> None:
    """The chosen configuration with a reason per choice, then the runners-up."""
    u = "GiB" if gib else "GB"
    head = (f"{model.name} on {args.gpus} x {args.accelerator} ({rec.budget / unit:g} {u}), "
            f"{args.network}, {recipe.name}")
    if rec.best is None:
        line(f"{head}: no configuration fits")
        line(rec.reasons["none"])
        return
    b = rec.best
    group = ("all (plain)" if b.shard_group is None else
             f"{b.shard_group} ({b.dp // b.shard_group} replicas)")
    values = {"stage": b.strategy, "tp": str(b.tp), "shard group": group,
              "unit size": f"{b.blocks_per_unit} block(s)",
              "prefetch": str(b.prefetch) if b.policy.shards_params else "-",
              "checkpointing": b.checkpointing,
              "micro-batch": f"{b.micro_batch} x {b.accumulation} steps",
              "offload": b.offload or "none"}
    t = Table(title=f"recommended: {head}", title_justify="left", show_lines=True)
    for col in ("choice", "value", "why"):
        t.add_column(col)
    for key, value in values.items():
        t.add_row(key, value, rec.reasons[key])
    _console().print(t)
    line(f"predicted step {b.time.step:.3f} s, {b.time.tokens_per_gpu:,.0f} tokens/s per GPU, "
         f"exposed communication {b.time.exposed:.3f} s, {b.memory / unit:.2f} {u} per GPU")
    for note in rec.notes:
        line(f"note: {note}")
    r = Table(title="runners-up (fastest first)", title_justify="left")
    for col in ("stage", "TP", "group", "blocks/unit", "prefetch", "ckpt", "micro x accum",
                f"mem {u}", "step s", "tokens/s/GPU", "exposed s", "vs best"):
        r.add_column(col, justify="left" if col == "stage" else "right")
    for c in (b, *rec.runners_up):
        r.add_row(*_config_row(c, b, unit))
    _console().print(r)
