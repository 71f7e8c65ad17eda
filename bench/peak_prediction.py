"""How far the planner's peak is from the peak a profile measures: the built-in GPTs and
Hugging Face GPT-2, Llama and Qwen2, at stages 1 and 3, in fp32 and bf16.

    python bench/peak_prediction.py            # the whole grid (about 3 minutes)
    python bench/peak_prediction.py gpt-tiny   # one model

N = 2, prefetch 1, 4 sequences per rank, one profiled training step after a first one.
The plan is ``zeroshard.plan.peak.peak(...).profiled``: the largest of the loss's
backward, each unit's backward (``plan/backward.py``: reductions in flight, landed
slots, gathers) and the optimizer step, without what the profiler cannot see
(autograd's gradients, full gradients at stages 2-3 before they are packed, the
optimizer's temporaries), from the architecture of each model (its family's activation
model, the root unit of embeddings and head). Planned and measured moments are named
by the engine's unit numbers (the root unit 0); the measured one is the profiler's
event at its peak.
"""

from __future__ import annotations

import sys

MODELS = ("gpt-tiny", "gpt-small", "hf-gpt2", "hf-llama", "hf-qwen2")


def _model(name: str, seq: int):
    """(module, Architecture, call) for one of :data:`MODELS`."""
    from zeroshard.plan import Architecture

    if name.startswith("gpt-"):
        from zeroshard.models.gpt import GPT, get_preset

        c = get_preset(name[4:])
        arch = Architecture(name, c.hidden, c.layers, c.heads, 4 * c.hidden, c.vocab, tied=True,
                            max_positions=c.block_size, gated_mlp=False, norm_bias=True,
                            linear_bias=True, family="gpt")
        return GPT(c), arch, (lambda net, x, y: net(x, y)), c.block_size
    import json
    import os
    import tempfile

    import transformers

    from zeroshard.plan import from_hf_config

    transformers.logging.set_verbosity_error()
    common = dict(vocab_size=256, hidden_size=128, num_hidden_layers=4,
                  num_attention_heads=4, max_position_embeddings=seq, bos_token_id=0,
                  eos_token_id=0, attn_implementation="sdpa")
    if name == "hf-gpt2":  # dropout off and a fused GELU, as the planner assumes
        cfg = transformers.GPT2Config(vocab_size=256, n_positions=seq, n_embd=128, n_layer=4,
                                      n_head=4, bos_token_id=0, eos_token_id=0,
                                      activation_function="gelu", resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0,
                                      attn_implementation="sdpa")
    elif name == "hf-llama":
        cfg = transformers.LlamaConfig(intermediate_size=344, num_key_value_heads=2,
                                       pad_token_id=0, **common)
    else:
        cfg = transformers.Qwen2Config(intermediate_size=344, num_key_value_heads=2, **common)
    path = os.path.join(tempfile.mkdtemp(), "config.json")
    with open(path, "w") as fh:
        json.dump(cfg.to_dict(), fh)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    call = lambda net, x, y: net(input_ids=x, labels=x, use_cache=False).loss  # noqa: E731
    return model, from_hf_config(path), call, seq


def _rank(name: str, stage: int, precision: str) -> dict:
    import torch
    import torch.distributed as dist

    import zeroshard as zs
    from zeroshard.data import Corpus
    from zeroshard.plan import ModelSpec, ParallelDims, Workload
    from zeroshard.plan.peak import peak

    rank, world = dist.get_rank(), dist.get_world_size()
    batch = 8
    torch.manual_seed(0)
    model, arch, call, seq = _model(name, 64)
    net = zs.shard(model, stage=stage, profile=True,
                   mixed_precision=None if precision == "fp32" else precision)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    corpus = Corpus.builtin()
    rows = slice(rank * batch // world, (rank + 1) * batch // world)
    for step in range(2):
        net.profiler.enabled = step == 1
        x, y = corpus.batch("train", 0, step, batch, seq)
        call(net, x[rows], y[rows]).backward()
        opt.step()
        opt.zero_grad()
    params = sum(u.w_layout.numel for u in net.units)
    assert params == arch.params, (params, arch.params)
    work = Workload(batch // world * seq, seq, checkpointing=False, flash_attention=True)
    plan = peak(ModelSpec.from_arch(arch), ParallelDims(world), net.zero_config, work,
                optimizer_impl="for-loop")
    _, at = net.profiler.peak()
    where = at.kind.replace("_", " ") + ("" if at.unit is None else f" (unit {at.unit})")
    return {"params": params, "planned": plan.profiled, "moment": plan.profiled_moment,
            "activations": plan.activations, "measured": net.profiler.total(at),
            "measured_activations": at.memory["activations"], "where": where}


def main() -> None:
    from zeroshard.runtime.spawn import spawn

    names = sys.argv[1:] or MODELS
    print(f"{'model':10} {'stage':>5} {'dtype':>5} {'params':>9} {'planned MB':>10} "
          f"{'measured MB':>11} {'error':>7}   planned at / measured at")
    errors = []
    for name in names:
        for stage in (1, 3):
            for precision in ("fp32", "bf16"):
                r = spawn(_rank, 2, name, stage, precision, timeout=600)[0]
                err = r["planned"] / r["measured"] - 1
                errors.append(abs(err))
                print(f"{name:10} {stage:>5} {precision:>5} {r['params']:>9,} "
                      f"{r['planned'] / 1e6:>10.3f} {r['measured'] / 1e6:>11.3f} {err:>+7.1%}   "
                      f"{r['moment']} / {r['where']}", flush=True)
    print(f"largest error {max(errors):.1%} over {len(errors)} rows")


if __name__ == "__main__":
    main()
