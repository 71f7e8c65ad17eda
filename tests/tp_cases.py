"""The shared library of the tensor-parallel tests (``tests/test_tp*.py``): the tiny
models, their batches, the meshes, and the runs each spawned rank makes (importable by
name, so the spawned ranks can unpickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zeroshard as zs
from zeroshard.models.gpt import GPT, GPTConfig
from zeroshard.models.tp import hf_plan, parallelize

BATCH, SEQ, VOCAB = 8, 8, 32
GPT_TINY = GPTConfig(vocab=VOCAB, block_size=SEQ, layers=2, heads=4, hidden=16)
#: (dp_replicate, dp_shard, tp) on 4 ranks: dp 2 × tp 2, tp 4, dp 4, and hybrid 2 × 1 × 2
LAYOUTS = {"dp2tp2": (1, 2, 2), "tp4": (1, 1, 4), "dp4": (1, 4, 1), "hsdp2x1tp2": (2, 1, 2)}


def llama_config():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")


def build(name: str):
    """The model, unparallelized, the same on every rank (seeded)."""
    torch.manual_seed(1234)
    if name == "gpt":
        return GPT(GPT_TINY)
    if name == "llama":
        import transformers

        return transformers.LlamaForCausalLM(llama_config())
    raise AssertionError(name)


def plan_of(name: str, model) -> dict:
    return GPT.TP_PLAN if name == "gpt" else hf_plan(model)


def loss(name: str, model, x, y):
    if name == "gpt":
        return model(x, y)
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def batch(step: int):
    """The global batch of a step: arithmetic sequences mod VOCAB (learnable)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (BATCH, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def mesh_of(layout: str):
    from torch.distributed.device_mesh import init_device_mesh

    r, k, t = LAYOUTS[layout]
    if r == 1:
        return init_device_mesh("cpu", (k, t), mesh_dim_names=("dp", "tp"))
    return init_device_mesh("cpu", (r, k, t), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))


def dp_coords(mesh) -> tuple[int, int]:
    """(data-parallel rank, data-parallel ranks) of this rank on ``mesh``."""
    names = mesh.mesh_dim_names
    if names == ("dp", "tp"):
        return mesh.get_local_rank("dp"), mesh.size(0)
    return (mesh.get_local_rank("dp_replicate") * mesh.size(1)
            + mesh.get_local_rank("dp_shard"), mesh.size(0) * mesh.size(1))


def rows(mesh, t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a global batch: by data-parallel rank (a tp group alike)."""
    r, n = dp_coords(mesh)
    per = t.shape[0] // n
    return t[r * per:(r + 1) * per]


def tp_model(name: str, mesh, stage: int, **options):
    model = build(name)
    parallelize(model, mesh["tp"], plan_of(name, model))
    return zs.shard(model, stage=stage, mesh=mesh, **options)


def make_optimizer(kind: str, params, lr: float):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)


def train(name: str, model, mesh, steps: int, optim: str = "sgd", clip=None,
          lr: float = 0.1, clip_fn=None) -> list[float]:
    """``steps`` steps on this rank's rows; the losses (this rank's)."""
    params = model.parameters()
    opt = make_optimizer(optim, params, lr)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        out = loss(name, model, rows(mesh, x), rows(mesh, y)) if mesh is not None else \
            loss(name, model, x, y)
        out.backward()
        if clip is not None:
            (clip_fn or model.clip_grad_norm_)(clip)
        opt.step()
        opt.zero_grad()
        losses.append(out.item())
    return losses


def reference(name: str, steps: int, optim: str = "sgd", clip=None, lr: float = 0.1) -> dict:
    """The unsharded model in one process on the whole global batch: its weights."""
    model = build(name)
    clip_fn = (lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c)) if clip else None
    train(name, model, None, steps, optim, clip, lr, clip_fn)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def distance(a: dict, b: dict) -> float:
    """Max |a - b| over every weight, relative to the largest |b|."""
    scale = max(v.abs().max().item() for v in b.values())
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b) / scale


def grid_parity(steps: int = 20):
    """SGD at every stage and layout, both models: each run's full weights, compared on
    rank 0 with one another (bit for bit) and with the one-process reference."""
    out = {}
    for name in ("gpt", "llama"):
        ref = reference(name, steps) if dist.get_rank() == 0 else None
        for layout in LAYOUTS:
            mesh = mesh_of(layout)
            for stage in range(4):
                model = tp_model(name, mesh, stage)
                train(name, model, mesh, steps)
                full = model.full_state_dict()
                if dist.get_rank() == 0:
                    out[name, layout, stage] = full
        if dist.get_rank() == 0:
            out[name, "ref"] = ref
    return out if dist.get_rank() == 0 else None
