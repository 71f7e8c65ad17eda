"""``zeroshard train --profile``: the trace, the chart, the peak, and the plan beside it.

The plan is the planner's peak (``plan/peak.py``) for the very configuration the engine
runs (``model.zero_config``) on its own layout (``report.layout``), and its categories
count what the ledger's count: every placement (offload's host and disk included)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from .._paths import record
from ..observe.trace import chrome_trace, lifetime_chart
from ..plan.arch import Architecture, ModelSpec
from ..plan.peak import peak
from ..plan.workload import Workload
from .hfmodel import gpt_architecture
from .report import layout

#: What ``--profile DIR`` writes into DIR: the chart, and a trace per rank (claimed
#: before launch, recorded after: [Note: a writer owns only what it wrote]).
PROFILE_FILES = ("lifetimes.png",)
PROFILE_PATTERNS = (r"trace-rank\d+\.json",)


def predicted(model, arch, tokens: int, seq_len: int,
              loss_outside: bool = False) -> tuple[dict[str, int], int]:
    """The planner's figures for this run (``zeroshard.plan.peak``: the model's
    architecture ``arch``, an Architecture or the built-in GPT's ``GPTConfig``, its
    workload, the engine's config and layout): per category at the peak, every
    placement together as the ledger counts them, and the peak as the profiler counts it
    (saved tensors, not kernels' scratch; ``Peak.counted``) under the activation
    checkpointing the engine runs (none where the model checkpoints itself), for
    ``tokens`` per rank per forward in sequences of ``seq_len``; ``loss_outside``: the
    loss is computed on the
    logits the model returns, where the profiler does not count its saved tensors
    (``Peak.unseen_loss``)."""
    if not isinstance(arch, Architecture):
        arch = gpt_architecture(arch)
    device = model.units[0].device.type
    mode = model.zero_config.activation_checkpointing if model.checkpointed_units else "none"
    work = Workload.of_mode(tokens, seq_len, mode, flash_attention=True, cpu=device == "cpu")
    impl = "foreach" if device == "cuda" else "for-loop"  # torch's pick
    p = peak(ModelSpec.from_arch(arch), layout(model), model.zero_config, work,
             optimizer_impl=impl, loss_outside=loss_outside)
    placed = p.placement
    return ({"params": placed.total("weights"), "grads": p.grads,
             "optimizer": placed.total("optimizer"),
             "activations": p.activations - p.unseen_loss}, p.counted)


def _loss_outside(source) -> bool:
    """Whether the trainer's loss of ``source`` runs outside the model's forward, where
    the profiler's saved-tensor hooks (``Profiler.forward_context``) do not count it:
    each source says (``loss_outside``)."""
    return source.loss_outside


def profile_report(model, cfg, source, micro: int, seq_len: int, rank: int, out) -> None:
    prof = model.profiler
    folder = Path(cfg.profile)
    folder.mkdir(parents=True, exist_ok=True)
    chrome_trace(prof, str(folder / f"trace-rank{rank}.json"), rank)
    statement = prof.peak_statement()
    if rank == 0:
        lifetime_chart(prof, str(folder / "lifetimes.png"),
                       f"{source.label}, ZeRO stage {cfg.zero.stage}, rank 0")
    plan, planned_total = predicted(model, source.architecture(), micro * seq_len, seq_len,
                                    _loss_outside(source))
    _, at = prof.peak()
    measured = {k: at.memory[k] for k in plan}
    statements = [None] * model.mesh.dp_world
    dist.all_gather_object(statements, statement, group=model.mesh.dp_group)
    if rank == 0:  # after every rank's trace is written
        traces = [f"trace-rank{r}.json" for r in range(dist.get_world_size())]
        record(folder, [*PROFILE_FILES, *traces])
    out.profile(folder, statements, plan, measured, prof.total(at), planned_total)
