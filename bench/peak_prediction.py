"""How far the planner's peak (persistent + transient terms + activations) is from the
peak a profile measures, for the built-in GPTs and Hugging Face GPT-2 and Llama.

    python bench/peak_prediction.py

N = 2, ZeRO stage 3, fp32, prefetch 1, one profiled training step after a first one.
"""

from __future__ import annotations


def _rank(name: str) -> dict:
    import torch
    import torch.distributed as dist

    import zeroshard as zs
    from zeroshard.data import Corpus
    from zeroshard.models.gpt import GPT, get_preset
    from zeroshard.plan import ModelSpec, Workload
    from zeroshard.train.profile import predicted

    rank, world = dist.get_rank(), dist.get_world_size()
    seq, batch = 64, 8
    if name.startswith("gpt-"):
        cfg = get_preset(name[4:])
        seq = cfg.block_size
        model, shape = GPT(cfg), (cfg.hidden, cfg.layers, cfg.heads)
        call = lambda net, x, y: net(x, y)  # noqa: E731
    else:
        import transformers

        transformers.logging.set_verbosity_error()
        if name == "hf-gpt2":
            c = transformers.GPT2Config(vocab_size=256, n_positions=seq, n_embd=128, n_layer=4,
                                        n_head=4, bos_token_id=0, eos_token_id=0)
            model, shape = transformers.GPT2LMHeadModel(c), (128, 4, 4)
        else:
            c = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344,
                                         num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=seq,
                                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
            model, shape = transformers.LlamaForCausalLM(c), (128, 4, 4)
        call = lambda net, x, y: net(input_ids=x, labels=x, use_cache=False).loss  # noqa: E731
    torch.manual_seed(0)
    net = zs.shard(model, stage=3, profile=True)
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
    plan = predicted(net, ModelSpec(name, params, *shape),
                     Workload(batch // world * seq, seq, checkpointing=False))
    _, peak = net.profiler.peak()
    return {"params": params, "plan": plan, "measured": peak.memory,
            "peak": net.profiler.total(peak)}


def main() -> None:
    from zeroshard.runtime.spawn import spawn

    print(f"{'model':10} {'params':>10} {'planned MB':>11} {'measured MB':>12} {'error':>8}   "
          "activations planned / measured MB")
    for name in ("gpt-tiny", "gpt-small", "hf-gpt2", "hf-llama"):
        r = spawn(_rank, 2, name, timeout=600)[0]
        planned = sum(r["plan"].values())
        act = (r["plan"]["activations"] / 1e6, r["measured"]["activations"] / 1e6)
        print(f"{name:10} {r['params']:>10,} {planned / 1e6:>11.3f} {r['peak'] / 1e6:>12.3f} "
              f"{(planned - r['peak']) / r['peak']:>+8.1%}   {act[0]:.3f} / {act[1]:.3f}")


if __name__ == "__main__":
    main()
