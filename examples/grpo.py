"""A GRPO-shaped loop on a sharded model: sample completions, score them, raise the
log-probability of the better ones against a frozen reference model sharded beside.

    torchrun --nproc-per-node 2 examples/grpo.py

A tiny Llama (transformers, built from its config: nothing is downloaded) learns to
write even token ids. Each rank samples 4 completions of its own prompt per step; an eos
ends some of them early, at different steps on each rank, and ``model.generate`` needs no
flag for it at stage 3 (docs/generation.md). The reward of a completion is its count of
even ids; a completion's advantage is its reward against its group's mean; the loss is
the advantage-weighted log-probability with a KL penalty to the reference (GRPO,
Shao et al. 2024, without the clipped ratio: one update per sample).
"""

import torch
import torch.nn.functional as F
import transformers

import zeroshard as zs

PROMPT, SAMPLES, NEW = 6, 4, 8


def tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)  # the same weights on every rank (zs.shard broadcasts rank 0's)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=1,
        pad_token_id=1))


def logprobs(model, seqs: torch.Tensor) -> torch.Tensor:
    """The log-probability of each completion token [batch, NEW]."""
    logits = model(input_ids=seqs, use_cache=False).logits[:, PROMPT - 1:-1].float()
    return torch.gather(F.log_softmax(logits, -1), 2, seqs[:, PROMPT:, None])[..., 0]


def main() -> None:
    transformers.logging.set_verbosity_error()
    rank, world = zs.init_distributed()
    policy = zs.shard(tiny_llama(), stage=3)
    reference = zs.shard(tiny_llama().requires_grad_(False), stage=3)  # frozen, sharded
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    prompt = torch.randint(2, 64, (1, PROMPT), generator=torch.Generator().manual_seed(rank))
    for step in range(30):
        seqs = policy.generate(prompt.repeat(SAMPLES, 1), do_sample=True, max_new_tokens=NEW,
                               pad_token_id=1, eos_token_id=1)
        completion = seqs[:, PROMPT:]
        mask = (torch.cumsum((completion == 1).long(), 1) == 0).float()  # up to the eos
        reward = ((completion % 2 == 0).float() * mask).sum(1)
        advantage = (reward - reward.mean()) / (reward.std() + 1e-4)
        with torch.no_grad():
            ref = logprobs(reference, seqs)
        lp = logprobs(policy, seqs)
        loss = -((advantage[:, None] * lp - 0.04 * (lp - ref)) * mask).sum() / mask.sum()
        loss.backward()
        policy.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean = torch.tensor([reward.mean().item()])
        torch.distributed.all_reduce(mean)
        if rank == 0 and step % 5 == 0:
            print(f"step {step:2d}: mean reward {mean.item() / world:.2f} of {NEW}")


if __name__ == "__main__":
    main()
