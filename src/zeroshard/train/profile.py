"""``zeroshard train --profile``: the trace, the chart, the peak, and the plan beside it."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from ..observe.trace import chrome_trace, lifetime_chart
from ..plan.arch import ModelSpec
from ..plan.memory import Workload, activation_bytes, model_state_bytes, transient_bytes


def predicted(model, spec: ModelSpec, work: Workload) -> dict[str, int]:
    """The planner's per-category figures for a sharded model, transient terms included
    (activations from the model's shape and the workload)."""
    recipe, world = model.zero_config.recipe, model.comm.dp_world
    params = sum(u.w_layout.numel for u in model.units)
    weights, grads, optimizer = model_state_bytes(params, world, recipe, model.stage)
    largest = max(u.w_layout.numel for u in model.units)
    out = {"params": weights, "grads": grads, "optimizer": optimizer,
           "activations": activation_bytes(spec, recipe, work) or 0}
    out.update(transient_bytes(recipe, model.stage, world, largest, model.zero_config.prefetch))
    return out


def profile_report(model, cfg, gpt_cfg, micro: int, rank: int, out) -> None:
    prof = model.profiler
    folder = Path(cfg.profile)
    folder.mkdir(parents=True, exist_ok=True)
    chrome_trace(prof, str(folder / f"trace-rank{rank}.json"), rank)
    statement = prof.peak_statement()
    if rank == 0:
        lifetime_chart(prof, str(folder / "lifetimes.png"),
                       f"GPT {cfg.model}, ZeRO stage {cfg.zero.stage}, rank 0")
    params = sum(u.w_layout.numel for u in model.units)
    spec = ModelSpec(cfg.model, params, gpt_cfg.hidden, gpt_cfg.layers, gpt_cfg.heads)
    plan = predicted(model, spec, Workload(micro * gpt_cfg.block_size, gpt_cfg.block_size,
                                           checkpointing=False))
    _, peak = prof.peak()
    measured = {k: peak.memory[k] for k in plan}
    statements = [None] * model.comm.dp_world
    dist.all_gather_object(statements, statement, group=model.comm.group)
    out.profile(folder, statements, plan, measured, prof.total(peak))
