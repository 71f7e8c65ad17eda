"""Models nobody here wrote, built from tiny configs (nothing is downloaded), and the
harness that trains each under torch DDP and under zeroshard on the same batches.

Hugging Face: Qwen2 and Mistral causal LMs, BERT (an encoder with integer buffers),
T5 (an encoder-decoder whose embedding is tied across encoder, decoder and head),
ResNet (BatchNorm: float and int64 buffers) and ViT (``[1, N, D]`` parameters: zero-row
shards on every rank but the first). Local: a mixture of experts whose gate routes each
rank's tokens to different experts, and a module of odd parameters (0-d, one row,
fewer rows than ranks) with float, int64 and bool buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zeroshard as zs

BATCH = 8  # global: 4 per rank at N = 2
HF_MODELS = ["qwen2", "mistral", "bert", "t5", "resnet", "vit"]


class Expert(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Top-1 routing over four experts: which experts a rank runs depends on its data.
    Its ``experts`` are the model's repeated blocks, so by default each is a unit."""

    def __init__(self, width: int = 8, experts: int = 4):
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(Expert(width) for _ in range(experts))
        self.out = nn.Linear(width, 2)

    def forward(self, x, y):
        h = self.inp(x)
        weight, choice = F.softmax(self.gate(h), -1).max(-1)
        mixed = torch.zeros_like(h)
        for k, expert in enumerate(self.experts):
            rows = (choice == k).nonzero().flatten()
            if len(rows):  # experts no token chose are not run at all
                mixed = mixed.index_add(0, rows, expert(h[rows]) * weight[rows, None])
        return F.mse_loss(self.out(h + mixed), y)


class Odd(nn.Module):
    """Parameters of awkward shapes and buffers of three dtypes."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-d
        self.row = nn.Parameter(torch.randn(1, 6))  # one row: empty shards past rank 0
        self.w = nn.Parameter(torch.randn(6, 6) / 3)
        self.bias = nn.Parameter(torch.zeros(6))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False, True, True, False, True]))
        self.register_buffer("mean", torch.zeros(6))

    def forward(self, x, y):
        if self.training:
            self.steps += 1
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        h = torch.tanh((x - self.mean) @ self.w + self.bias + self.row) * self.scale
        return F.mse_loss(h * self.mask, y)


def _hf(name: str) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    t = transformers
    lm = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
              bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(**lm))
    if name == "mistral":
        return t.MistralForCausalLM(t.MistralConfig(**lm, sliding_window=None))
    if name == "bert":
        return t.BertForMaskedLM(t.BertConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=24, max_position_embeddings=16, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, pad_token_id=0))
    if name == "t5":
        return t.T5ForConditionalGeneration(t.T5Config(
            vocab_size=32, d_model=16, d_kv=8, d_ff=24, num_layers=2, num_decoder_layers=2,
            num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
            eos_token_id=1))
    if name == "resnet":
        return t.ResNetForImageClassification(t.ResNetConfig(
            num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
            layer_type="basic", num_labels=4))
    if name == "vit":
        return t.ViTForImageClassification(t.ViTConfig(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
            image_size=8, patch_size=4, num_channels=3, num_labels=4, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0))
    raise AssertionError(name)


def _saved_and_loaded(name: str) -> nn.Module:
    """``name`` saved in Hugging Face layout by rank 0 (transformers writes only from the
    main process) and loaded back by every rank with ``from_pretrained``, whose weights
    are memory-mapped from the file (storages that cannot be resized)."""
    import tempfile

    import transformers

    folder = [tempfile.mkdtemp(prefix="zeroshard-saved-") if dist.get_rank() == 0 else None]
    if dist.get_rank() == 0:
        _hf(name).save_pretrained(folder[0])
    dist.broadcast_object_list(folder, src=0)
    return transformers.AutoModelForCausalLM.from_pretrained(folder[0])


def build(name: str) -> nn.Module:
    torch.manual_seed(1234)
    if name.endswith(" from_pretrained"):
        return _saved_and_loaded(name.split()[0])
    if name == "moe":
        return MoE()
    if name == "odd":
        return Odd()
    return _hf(name)


def batch(name: str, step: int) -> dict:
    """This rank's share of the global batch of ``step`` (the same for every run)."""
    g = torch.Generator().manual_seed(100 + step)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    if name.split()[0] in ("qwen2", "mistral", "bert"):
        ids = torch.randint(1, 32, (BATCH, 8), generator=g)[rows]
        return {"input_ids": ids, "labels": ids}
    if name == "t5":
        ids = torch.randint(2, 32, (BATCH, 8), generator=g)[rows]
        return {"input_ids": ids, "labels": ids.flip(1)[:, :6].contiguous()}
    if name in ("resnet", "vit"):
        size = 16 if name == "resnet" else 8
        pixels = torch.randn(BATCH, 3, size, size, generator=g)[rows]
        return {"pixel_values": pixels, "labels": torch.randint(0, 4, (BATCH,), generator=g)[rows]}
    x = torch.randn(BATCH, 6, generator=g)
    return {"x": x[rows], "y": (x[:, :2] * 2 if name == "moe" else x.sin())[rows]}


def loss_of(net, name: str, data: dict) -> torch.Tensor:
    out = net(**data)
    return out if torch.is_tensor(out) else out.loss


def train(name: str, stage, steps: int = 3, **options):
    """Full weights and buffers after ``steps`` AdamW steps, under torch DDP (``stage``
    "ddp") or zeroshard."""
    model = build(name)
    if stage == "ddp":
        net = nn.parallel.DistributedDataParallel(model, find_unused_parameters=name == "moe")
        params = model.parameters()
    else:
        net = zs.shard(model, stage=stage, **options)
        params = net.parameters()
    opt = torch.optim.AdamW(params, lr=1e-2 if name in ("moe", "odd") else 1e-3)
    for step in range(steps):
        loss_of(net, name, batch(name, step)).backward()
        opt.step()
        opt.zero_grad()
    if stage == "ddp":
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return net.full_state_dict()


def max_rel_diff(a: dict, b: dict) -> float:
    """Largest difference over every tensor (buffers too), relative to the largest
    float value of ``b``."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    scale = max(v.abs().max().item() for v in b.values() if v.is_floating_point() and v.numel())
    return max(((a[k].double() - b[k].double()).abs().max().item() if b[k].numel() else 0.0)
               for k in b) / scale


def attempt(fn):
    """``fn()``'s result, or the (type, message) of the ValueError, NotImplementedError
    or RanksOutOfStep it raised."""
    from zeroshard.runtime.watch import RanksOutOfStep

    try:
        return fn()
    except (ValueError, NotImplementedError, RanksOutOfStep) as exc:
        return (type(exc).__name__, str(exc))
