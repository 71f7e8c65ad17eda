"""The torch.compile grid test_compile.py's one spawn runs on every rank: tiny Hugging
Face GPT-2 and Llama models trained sharded and compiled, the sharded model whole or
each unit's module before ``zs.shard`` (torchtitan's way), against eager torch DDP.

Graph breaks are counted twice: as dynamo counts them while compiling (a break inside
nested calls is counted again in each caller it unwinds through), and as a step runs
them — the graphs one forward executes, counted by a backend that wraps the one asked
for; a step with g graphs has g - 1 breaks."""

from __future__ import annotations

import torch

import zeroshard as zs

from . import engine_cases as cases


def counting(backend: str, runs: list):
    """``backend``, with every call of a compiled graph appended to ``runs``."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(backend)

    def compile_fn(gm, example_inputs):
        compiled = inner(gm, example_inputs)

        def run(*args):
            runs.append(1)
            return compiled(*args)

        return run

    return compile_fn


def blocks_of(model) -> torch.nn.ModuleList:
    lm = model.lm
    return lm.transformer.h if hasattr(lm, "transformer") else lm.model.layers


def train(kind: str, stage, how: str, backend: str = "inductor", steps: int = 3) -> dict:
    """Weights after ``steps`` AdamW steps of ``kind`` at ``stage`` ("ddp": torch DDP,
    eager), compiled as ``how`` says: "model" (torch.compile of the sharded model),
    "blocks" (each block compiled before zs.shard), "units" (``model.compile()``: each
    unit's forward, after), or "eager"."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, runs = cases.build(kind), []
    compiler = counting(backend, runs)
    if how == "blocks":
        blocks = blocks_of(model)
        for i in range(len(blocks)):
            blocks[i] = torch.compile(blocks[i], backend=compiler)
    if stage == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    else:
        net = zs.shard(model, stage=stage)
        opt = cases.make_optimizer("adamw", net.named_parameters(), 1e-3)
    if how == "units":
        net.compile(backend=compiler)
    step_fn = torch.compile(net, backend=compiler) if how == "model" else net
    graphs = []
    for step in range(steps):
        before = len(runs)
        x, y = cases.batch(kind, step)
        step_fn(x, y).backward()
        opt.step()
        opt.zero_grad()
        graphs.append(len(runs) - before)
    weights = (net.full_state_dict() if stage != "ddp" else
               {k: v.detach().clone() for k, v in model.state_dict().items()})
    weights = {k.replace("._orig_mod", ""): v for k, v in weights.items()}
    return {"weights": weights, "graphs": graphs, "units": len(getattr(net, "units", ())),
            "compile_breaks": sum(counters["graph_break"].values()),
            "reasons": sorted({r.splitlines()[0] for r in counters["graph_break"]})}


def compile_grid() -> dict:
    """Per model, stage and way: the largest difference to eager DDP (relative to the
    weights' largest), graphs run per step, units and dynamo's break count."""
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1  # two ranks on two cores: no worker pool
    out = {}
    for kind in ("hf_gpt2", "hf_llama"):
        ref = train(kind, "ddp", "eager")["weights"]
        for stage, how in ((0, "model"), (3, "model"), (3, "blocks"), (3, "units")):
            r = train(kind, stage, how)
            diff = cases.max_rel_diff(r.pop("weights"), ref)
            out[(kind, stage, how)] = {**r, "diff": diff}
    return out
