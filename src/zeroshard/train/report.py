"""What ``zeroshard train`` prints on rank 0: a header, a progress bar, evaluation lines,
measured memory per rank beside the planner's prediction, communication per step, and
a text sample.

The planner is asked about the very configuration the engine runs: ``model.zero_config``
(its recipe, offload and where, ZeRO++) on the engine's own layout (:func:`layout`), so
the table cannot plan a different question from the one measured."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from ..plan.comm import comm_bytes, ring_one_way
from ..plan.placement import model_state_bytes
from ..spec.config import ZeroConfig
from ..spec.dims import ParallelDims
from .settings import processes

MB = 1e6


def layout(model) -> ParallelDims:
    """The engine's layout of a sharded ``model``: its mesh's sizes (the data-parallel
    ranks, the shard group's K, hpZ's K2), the very ``ParallelDims`` the planner reads."""
    return model.mesh.dims


def planned_comm(params: int, dims: ParallelDims, config: ZeroConfig, accum: int,
                 units: list[int] | None = None, trainable: int | None = None) -> int:
    """Bytes a rank sends per step as planned, with ``accum`` micro-batches per step:
    every backward reduces its gradients (the loop never skips communication with
    ``no_sync``; under hybrid sharding the all-reduce across groups follows each), and
    where the weights are sharded every forward and backward gathers them; stages 1-2
    gather once, after the step. One micro-batch: the planner's figure (hpZ and the
    quantized collectives planned per unit of ``units`` elements). ``trainable``: of the
    parameters, those that train (LoRA's adapters: their gradients alone travel)."""
    once = comm_bytes(params, dims, config, units, trainable)
    if config.policy.gathers_after_step:
        weights = config.recipe.weight_bytes * (params if trainable is None else trainable)
        return accum * once - (accum - 1) * ring_one_way(weights, dims.shard_size)
    return accum * once


class Reporter:
    """Rank 0's output; every method is a no-op elsewhere."""

    def __init__(self, cfg, world: int, micro: int, accum: int, params: int, enabled: bool,
                 label: str | None = None, origin: str = ""):
        self.cfg, self.world, self.params, self.enabled = cfg, world, params, enabled
        self.label, self.origin = label or f"GPT {cfg.model}", origin
        self.micro, self.accum = micro, accum
        console = Console(highlight=False)
        # keep the tables whole when stdout is a pipe or a narrow terminal
        self.console = console if console.width >= 100 else Console(highlight=False, width=100)
        self.progress = None
        self.steps_done = 0
        self.trainable: int | None = None  # LoRA: the elements that train (set up: loop.py)

    def _trained(self) -> str:
        """The adapters, when only they train (``--lora``)."""
        if self.trainable is None:
            return ""
        return f", {self.trainable:,} of them LoRA r={self.cfg.lora} adapters that train"

    def header(self) -> None:
        """The run's settings, before anything is loaded."""
        if not self.enabled:
            return
        c, z = self.cfg, self.cfg.zero
        units = "model" if z.units is None else z.units
        tp = f", TP {c.tp} (ZeRO over {self.world // c.tp})" if c.tp > 1 else ""
        self.console.print(
            f"zeroshard train: {self.label} ({self.params:,} params{self._trained()})"
            f"{self.origin}, "
            f"{processes(self.world)}{tp}, "
            f"ZeRO stage {z.stage}, {z.mixed_precision or 'fp32'}, units={units}; global "
            f"batch {c.batch} = "
            f"{self.world // c.tp} x {self.micro} x {self.accum} micro-batch(es), "
            f"{c.steps} steps")

    def start(self, val_loss: float, first_step: int = 0) -> None:
        if not self.enabled:
            return
        c = self.cfg
        resumed = " (resumed)" if first_step else ""
        self.console.print(f"step {first_step}{resumed}: val loss {val_loss:.4f}")
        self.progress = Progress(
            TextColumn("step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("ETA"), TimeRemainingColumn(), console=self.console)
        self.task = self.progress.add_task("train", total=c.steps, completed=first_step,
                                           loss="-", tps="-")
        self.progress.start()

    def step(self, record: dict) -> None:
        self.steps_done += 1
        if self.enabled:
            self.progress.update(self.task, advance=1, loss=f"{record['loss']:.4f}",
                                 tps=f"{record['tokens_per_s']:,.0f}")

    def eval_line(self, record: dict) -> None:
        if self.enabled:
            self.progress.console.print(
                f"step {record['step']}: train loss {record['train_loss']:.4f}, "
                f"val loss {record['val_loss']:.4f}")

    def note(self, text: str) -> None:
        if self.enabled:
            (self.progress.console if self.progress else self.console).print(text)

    def line(self, text: str) -> None:
        """``text`` as one line, however long (not wrapped, no markup)."""
        if self.enabled:
            (self.progress.console if self.progress else self.console).print(
                text, soft_wrap=True, markup=False, highlight=False)

    def skipped(self, step: int, in_a_row: int, total: int) -> None:
        if self.enabled:
            self.progress.console.print(
                f"step {step} skipped (non-finite gradients): {in_a_row} in a row, {total} "
                f"in all; the run stops at {self.cfg.max_skipped} in a row")

    def stop(self) -> None:
        if self.enabled and self.progress is not None:
            self.progress.stop()

    def summary(self, memories: list[dict], comm: dict, config: ZeroConfig,
                dims: ParallelDims, units: list[int] | None = None,
                tp_planned: int = 0) -> None:
        """Memory per rank and traffic per step, measured beside planned for ``config``
        (the engine's) on ``dims`` (its layout: :func:`layout`); ``units``: each unit's
        elements (hpZ and quantized slots are planned per unit; beside tensor
        parallelism tp × a rank's, ``plan/tp.py``'s count). The planned categories
        hold every placement, as the ledger's do (an offloaded optimizer's host master
        included); ``tp_planned``: tensor parallelism's own bytes per step, planned."""
        if not self.enabled:
            return
        recipe = config.recipe
        params = sum(units) if units else self.params  # tp x a rank's beside TP (plan/tp.py)
        weights, grads, optimizer = model_state_bytes(params, dims, config,
                                                      trainable=self.trainable)
        hybrid = f", shard groups of {dims.shard_size}" if dims.replicas > 1 else ""
        hybrid += f", TP {dims.tp}" if dims.tp > 1 else ""
        offload = f", offload {config.offload}" if config.offload else ""
        t = Table(title=f"memory per rank (MB): measured by the ledger / planned "
                        f"({recipe.name}, stage {config.stage}, N = {dims.dp}{hybrid}"
                        f"{offload})", title_justify="left")
        for col in ("rank", "params", "grads", "optimizer", "padding", "gathered", "buffers"):
            t.add_column(col, justify="right")
        for r, m in enumerate(memories):
            t.add_row(str(r), *(f"{m[k] / MB:.3f} / {p / MB:.3f}" for k, p in
                                (("params", weights), ("grads", grads), ("optimizer", optimizer))),
                      *(f"{m[k] / MB:.3f}" for k in ("padding", "gathered", "buffers")))
        self.console.print(t)
        steps = max(1, self.steps_done)
        planned = planned_comm(params, dims, config, self.accum, units,
                               self.trainable) + tp_planned
        t = Table(title="communication per step, rank 0 (MB sent, ring accounting)",
                  title_justify="left")
        for col in ("collective", "calls/step", "MB/step"):
            t.add_column(col, justify="right")
        for kind, s in comm.items():
            t.add_row(kind, f"{s['calls'] / steps:g}", f"{s['bytes'] / steps / MB:.3f}")
        # the engine's checks (fingerprints, agreements) are shown, not planned or totalled
        sent = sum(s["bytes"] for kind, s in comm.items() if kind != "check")
        t.add_row("total", "", f"{sent / steps / MB:.3f}")
        t.add_row("planned", f"{self.accum} micro-batches" if self.accum > 1 else "",
                  f"{planned / MB:.3f}")
        self.console.print(t)

    def profile(self, folder, statements, plan, measured, peak_total, planned_total) -> None:
        if not self.enabled:
            return
        for r, line in enumerate(statements):
            self.console.print(f"rank {r}: {line}")
        t = Table(title="rank 0 at its peak (MB): planned / measured", title_justify="left")
        for col in ("category", "planned", "measured", "difference"):
            t.add_column(col, justify="right")
        for k, p in plan.items():
            t.add_row(k, f"{p / MB:.3f}", f"{measured[k] / MB:.3f}",
                      f"{(measured[k] - p) / MB:+.3f}")
        total = planned_total  # the planner's peak (plan.peak): its moment, not a sum
        t.add_row("peak", f"{total / MB:.3f}", f"{peak_total / MB:.3f}",
                  f"{(peak_total - total) / MB:+.3f} ({(peak_total - total) / total:+.1%})")
        self.console.print(t)
        if measured.get("grads", 0) < plan.get("grads", 0):
            self.console.print("gradients are held from a unit's first reduction to the step: "
                               "at a peak inside backward, only those of the units reduced so "
                               "far (the planned figure is the bound, reached at the step)")
        self.console.print(f"trace per rank and lifetimes.png in {folder}")

    def sample(self, text: str) -> None:
        if self.enabled:
            self.console.print("sample:", style="bold")
            self.console.print(text, markup=False)
