"""``zeroshard train --profile``: the trace, the chart, the peak, and the plan beside it."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from ..observe.trace import chrome_trace, lifetime_chart
from ..plan.arch import Architecture, ModelSpec
from ..plan.memory import Workload
from ..plan.peak import peak


def gpt_architecture(c) -> Architecture:
    """The built-in GPT of ``GPTConfig`` ``c`` as the planner describes models."""
    return Architecture("gpt", c.hidden, c.layers, c.heads, 4 * c.hidden, c.vocab, tied=True,
                        max_positions=c.block_size, gated_mlp=False, norm_bias=True,
                        linear_bias=True, family="gpt")


def predicted(model, arch, tokens: int, seq_len: int,
              loss_outside: bool = False) -> tuple[dict[str, int], int]:
    """The planner's figures for this run (``zeroshard.plan.peak``: the model's
    architecture ``arch``, an Architecture or the built-in GPT's ``GPTConfig``, and its
    workload): per category at the peak, and the peak the profiler can see (saved
    tensors, not kernels' scratch), for ``tokens`` per rank per forward in sequences of
    ``seq_len``; ``loss_outside``: the loss is computed on the logits the model returns,
    where the profiler does not count its saved tensors (``Peak.unseen_loss``)."""
    recipe, world = model.zero_config.recipe, model.mesh.dp_world
    if not isinstance(arch, Architecture):
        arch = gpt_architecture(arch)
    device = model.units[0].device.type
    work = Workload(tokens, seq_len, checkpointing=False, flash_attention=True,
                    cpu=device == "cpu")
    impl = "foreach" if device == "cuda" else "for-loop"  # torch's pick
    p = peak(ModelSpec.from_arch(arch), recipe, work, world, model.stage,
             model.zero_config.prefetch, optimizer_impl=impl,
             shard_group=model.mesh.shard_world, loss_outside=loss_outside)
    return ({"params": p.weights, "grads": p.grads, "optimizer": p.optimizer,
             "activations": p.activations - p.unseen_loss}, p.profiled)


def _loss_outside(source) -> bool:
    """The trainer's loss of a Hugging Face model (``models/hf.lm_loss``) is a
    cross-entropy on the logits the model returns: it runs after the model's forward,
    outside the profiler's saved-tensor hooks (``Profiler.forward_context``), while the
    built-in GPT computes its loss inside its forward."""
    from .hfmodel import HFCausalLM

    return isinstance(source, HFCausalLM)


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
    out.profile(folder, statements, plan, measured, prof.total(at), planned_total)
