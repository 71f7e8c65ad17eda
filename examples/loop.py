"""The ordinary PyTorch loop, sharded. Run: torchrun --nproc-per-node 2 examples/loop.py [STAGE]"""

import sys

import torch

import zeroshard as zs
from zeroshard.models.gpt import GPT, GPTConfig

rank, world = zs.init_distributed()
stage = int(sys.argv[1]) if len(sys.argv) > 1 else 3
torch.manual_seed(0)
model = zs.shard(GPT(GPTConfig()), stage=stage, mixed_precision="bf16")
decay = [p for p in model.parameters() if p.dim() >= 2]  # nanoGPT's param groups still work
other = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                               {"params": other, "weight_decay": 0.0}], lr=3e-3)
text = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 40))
for step in range(30):
    starts = torch.randint(0, len(text) - 65, (8,), generator=torch.Generator().manual_seed(step))
    batch = torch.stack([text[s:s + 65] for s in starts])[rank::world]  # this rank's share
    loss = model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    model.clip_grad_norm_(1.0)
    optimizer.step()
    optimizer.zero_grad()
    if step % 10 == 9 and rank == 0:
        print(f"step {step + 1}: loss {loss.item():.3f}")
if rank == 0:
    print("memory on rank 0 (bytes):", model.memory(optimizer))
    print("communication (bytes sent by rank 0):", model.comm_stats())
