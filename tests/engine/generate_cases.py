"""The generation grids ``test_generate.py``'s spawns run on every rank: a tiny Hugging Face
Llama (and a peft LoRA of it) generating at stage 3 with ranks that stop at different
lengths, against the same model unsharded on each rank; a GRPO-shaped loop (sample with an
eos, score, raise the log-probability of the better completions against a frozen
reference model, clip, step) at stages 0-3 against torch DDP on the same samples."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zeroshard as zs

VOCAB, PROMPT = 48, 5


def llama(seed: int = 7) -> nn.Module:
    """A Llama of two blocks, width 32, its eos token 1."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return transformers.LlamaForCausalLM(cfg)


def prompts(rank: int, rows: int = 2) -> torch.Tensor:
    """Each rank's own prompts (ids 2 and up: no eos inside them)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(2, VOCAB, (rows, PROMPT), generator=g)


def _eos_after(model: nn.Module, prompt: torch.Tensor, k: int) -> int:
    """The token the model's greedy continuation of ``prompt`` holds at position ``k``:
    as eos, it ends that sequence there."""
    out = model.generate(prompt, max_new_tokens=k + 1, do_sample=False,
                         pad_token_id=1, eos_token_id=None)
    return int(out[0, PROMPT + k])


def uneven(world_mode: str, lora: bool = False) -> dict:
    """On every rank: the unsharded model's and the stage-3 model's generations when ranks
    ask for different lengths (``max_new_tokens`` 3 + 5·rank), and when rank 0's first
    sequence meets an eos after two tokens while the others run on; ``world_mode``:
    ``ZeroConfig.generate_gather``."""
    rank = dist.get_rank()
    ref = llama()
    if lora:
        ref = _with_lora(ref)
    x = prompts(rank)
    eos_at = torch.tensor([_eos_after(ref, prompts(0)[:1], 2)])
    dist.broadcast(eos_at, 0)
    asks = [dict(max_new_tokens=3 + 5 * rank, eos_token_id=None),
            dict(max_new_tokens=10, eos_token_id=int(eos_at))]
    want = [ref.generate(x, do_sample=False, pad_token_id=1, **a).tolist() for a in asks]
    model = llama()
    if lora:
        model = _with_lora(model)
    sharded = zs.shard(model, stage=3, generate_gather=world_mode)
    before = sharded.memory()["gathered"]
    start = time.perf_counter()
    got = [sharded.generate(x, do_sample=False, pad_token_id=1, **a).tolist() for a in asks]
    return {"equal": got == want, "lengths": [len(g[0]) for g in got],
            "seconds": time.perf_counter() - start, "gathered_before": before,
            "gathered_after": sharded.memory()["gathered"],
            "whole": sharded.gathers_whole()}


def _with_lora(model: nn.Module) -> nn.Module:
    import peft

    torch.manual_seed(11)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8,
                                                      target_modules=["q_proj", "v_proj"]))
    for name, p in lora.named_parameters():  # B made non-zero: the adapters change outputs
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)
    return lora


def uneven_grid() -> dict:
    return {(mode, lora): uneven(mode, lora) for mode in ("whole", "unit")
            for lora in (False, True)}


# -- a GRPO-shaped loop -----------------------------------------------------------------


def _completion_logprobs(model, seqs: torch.Tensor) -> torch.Tensor:
    """Per sequence, the log-probabilities of its completion tokens [b, T - PROMPT]."""
    logits = model(input_ids=seqs, use_cache=False).logits[:, PROMPT - 1:-1].float()
    return torch.gather(F.log_softmax(logits, dim=-1), 2, seqs[:, PROMPT:, None])[..., 0]


def _step(policy, reference, generate, x, it: int, rank: int, optimizer, clip) -> list:
    """One iteration: 4 samples per prompt (an eos ends some early), rewards (the count of
    even tokens), group-relative advantages, the policy-gradient loss with a KL penalty
    against the frozen reference, clipped, stepped. Returns the samples."""
    torch.manual_seed(1000 + 10 * it + rank)  # the same draws as the other run's
    seqs = generate(x.repeat_interleave(4, 0), do_sample=True, max_new_tokens=6,
                    eos_token_id=1, pad_token_id=1, top_k=0, top_p=1.0)
    done = torch.cumsum((seqs[:, PROMPT:] == 1).long(), 1)
    mask = ((done == 0) | ((done == 1) & (seqs[:, PROMPT:] == 1))).float()  # to eos
    reward = ((seqs[:, PROMPT:] % 2 == 0).float() * mask).sum(1)
    grouped = reward.view(-1, 4)
    advantage = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True)
                                                               + 1e-4)).view(-1)
    with torch.no_grad():
        ref_lp = _completion_logprobs(reference, seqs)
    lp = _completion_logprobs(policy, seqs)
    kl = (lp - ref_lp) * mask
    loss = -((advantage[:, None] * lp * mask).sum() - 0.05 * kl.sum()) / mask.sum()
    loss.backward()
    clip()
    optimizer.step()
    optimizer.zero_grad()
    return seqs.tolist()


def grpo(stage: int, iterations: int = 5) -> dict:
    """On every rank: the loop through ``zs.shard`` at ``stage`` (the reference a frozen
    stage-3 model beside it) and through torch DDP (the reference a plain copy), the
    samples of both and their weights' largest difference after ``iterations``."""
    rank = dist.get_rank()
    x = prompts(rank, rows=1)
    ddp_model = llama()
    ddp = nn.parallel.DistributedDataParallel(ddp_model)
    ddp_ref = llama().requires_grad_(False)
    opt = torch.optim.AdamW(ddp_model.parameters(), lr=2e-2)
    want = [_step(ddp, ddp_ref, ddp_model.generate, x, it, rank, opt,
                  lambda: nn.utils.clip_grad_norm_(ddp_model.parameters(), 0.5))
            for it in range(iterations)]
    policy = zs.shard(llama(), stage=stage)
    reference = zs.shard(llama().requires_grad_(False), stage=3)  # GRPO's frozen reference
    opt = torch.optim.AdamW(policy.parameters(), lr=2e-2)
    got = [_step(policy, reference, policy.generate, x, it, rank, opt,
                 lambda: policy.clip_grad_norm_(0.5)) for it in range(iterations)]
    full = policy.full_state_dict()
    ref_state = ddp_model.state_dict()
    diff = max((full[k] - ref_state[k]).abs().max().item() for k in ref_state)
    return {"samples_equal": got == want, "diff": diff,
            "ended_early": any(1 in row[PROMPT:-1] for it in got for row in it)}


def grpo_grid(stages=(0, 1, 2, 3)) -> dict:
    return {stage: grpo(stage) for stage in stages}


def frozen_teacher() -> dict:
    """A fully frozen model sharded at stage 3 (a distillation teacher): its logits equal
    the unsharded model's, and a student trained against it steps as under DDP."""
    rank = dist.get_rank()
    x = prompts(rank)
    teacher = zs.shard(llama(3).requires_grad_(False), stage=3)
    want = llama(3)(input_ids=x).logits
    with torch.no_grad():
        got = teacher(input_ids=x).logits
    student = zs.shard(llama(), stage=3)
    opt = torch.optim.SGD(student.parameters(), lr=0.5)
    with torch.no_grad():
        target = F.softmax(teacher(input_ids=x).logits, -1)
    loss = F.kl_div(F.log_softmax(student(input_ids=x).logits, -1), target,
                    reduction="batchmean")
    loss.backward()
    opt.step()
    return {"teacher_diff": (got - want).abs().max().item(), "loss": loss.item(),
            "memory": teacher.memory()}
