"""Generation on a stage-3 model against the same model unsharded, in the same ranks.

    python bench/generate.py                      # tiny Llama and GPT medium, N = 2
    python bench/generate.py --tokens 64 --rounds 7 --nproc 4

Every rank holds the model twice: sharded at stage 3 (``zs.shard``) and whole (the
unsharded model, a plain copy: what one process generates with). Rounds take turns
between the three ways — unsharded, stage 3 with the weights gathered once for the
generation (``generate_gather="whole"``), stage 3 gathered unit by unit at every token
(``"unit"``, with ``synced_gpus``) — on the same prompt, greedy, ``--tokens`` new tokens
each, so a slow spell of the machine falls on all three alike; reported per model is each
way's median seconds and its ratio to the unsharded model's, and whether the three
generated the same tokens. The tiny Llama (transformers', 2 blocks of width 64) goes
through ``model.generate``; the built-in GPT medium (10.8M parameters) through its own
sampling loop (``GPT.generate``), inside ``model.inference()`` for the gathered-once way.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _llama():
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=0, eos_token_id=None, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def _gpt():
    import torch

    from zeroshard.models.gpt import GPT, get_preset

    torch.manual_seed(0)
    return GPT(get_preset("medium"))


def _ways(name: str, tokens: int):
    """(label, build, generate(model, prompt) -> token list) per way."""
    import torch

    import zeroshard as zs
    from zeroshard.models.gpt import GPT

    build = _llama if name == "llama" else _gpt
    if name == "llama":
        def run(model, prompt):
            return model.generate(prompt, max_new_tokens=tokens, do_sample=False,
                                  pad_token_id=0).tolist()
    else:
        def run(model, prompt):
            g = torch.Generator().manual_seed(0)
            if isinstance(model, zs.ShardedModel):
                with model.inference():
                    return GPT.generate(model.module, prompt, tokens, generator=g,
                                        forward=model).tolist()
            return GPT.generate(model, prompt, tokens, generator=g).tolist()
    return build, run


def measure(name: str, tokens: int, rounds: int) -> dict:
    """On every rank: each way's seconds per generation, round by round."""
    import torch
    import torch.distributed as dist

    import zeroshard as zs

    build, run = _ways(name, tokens)
    plain = build().eval()
    ways = {"unsharded": plain,
            "stage 3, gathered once": zs.shard(build(), stage=3, generate_gather="whole"),
            "stage 3, unit by unit": zs.shard(build(), stage=3, generate_gather="unit")}
    for m in ways.values():
        m.eval()
    prompt = torch.randint(1, 255, (1, 8), generator=torch.Generator().manual_seed(1))
    times = {k: [] for k in ways}
    outputs = {}
    with torch.no_grad():
        for r in range(rounds + 1):  # the first round warms every way up
            order = list(ways) if r % 2 else list(reversed(ways))
            for k in order:
                dist.barrier()
                t0 = time.perf_counter()
                outputs[k] = run(ways[k], prompt)
                if r:
                    times[k].append(time.perf_counter() - t0)
    same = len({str(v) for v in outputs.values()}) == 1
    return {"times": times, "same": same}


def main() -> None:
    from zeroshard.runtime.spawn import spawn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32, help="new tokens per generation")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per way")
    p.add_argument("--models", default="llama,gpt", help="llama, gpt or both")
    args = p.parse_args()
    for name in args.models.split(","):
        r = spawn(measure, args.nproc, name, args.tokens, args.rounds, timeout=1800)[0]
        base = statistics.median(r["times"]["unsharded"])
        label = "tiny Llama (transformers)" if name == "llama" else "GPT medium (built-in)"
        print(f"{label}, N = {args.nproc}, {args.tokens} new tokens, median of "
              f"{args.rounds} rounds; the same tokens every way: {r['same']}")
        for way, ts in r["times"].items():
            med = statistics.median(ts)
            print(f"  {way:24s} {med * 1e3:9.1f} ms  {med / base:6.2f}x unsharded")


if __name__ == "__main__":
    main()
