"""The LoRA grid that test_lora.py's one spawn runs on every rank: peft adapters on a
tiny Hugging Face Llama and on the built-in GPT, trained by torch DDP and by zeroshard at
stages 0-3 with the default units, and peft's own calls on the sharded model."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zeroshard as zs
from zeroshard.models.gpt import GPT

from . import engine_cases as cases

RANK = 4
LR = 1e-3
TARGETS = {"llama": ["q_proj", "v_proj"], "gpt": ["q", "v"]}


def base(kind: str) -> nn.Module:
    """The model LoRA adapts, the same on every call."""
    torch.manual_seed(1234)
    if kind == "llama":
        return cases._hf("llama").lm
    return GPT(cases.GPT_SMALL)


def build(kind: str, **lora) -> nn.Module:
    """``base(kind)`` with LoRA adapters (peft); B starts random rather than at zero, so
    that the first steps move A too."""
    import peft

    model = peft.get_peft_model(base(kind), peft.LoraConfig(
        r=RANK, lora_alpha=8, target_modules=TARGETS[kind], **lora))
    torch.manual_seed(99)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.02)
    return model


def logits(kind: str, model, x) -> torch.Tensor:
    return model(input_ids=x).logits if kind == "llama" else model(x)


def loss(kind: str, model, x, y) -> torch.Tensor:
    out = logits(kind, model, x)
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


def train(kind: str, stage, steps: int, model=None, seen=None):
    """Train ``build(kind)`` with DDP (``stage="ddp"``) or zeroshard; the network and its
    optimizer. ``seen`` gets the memory read in the last step's pre-hook."""
    model = build(kind) if model is None else model
    if stage == "ddp":
        net = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    else:
        net = zs.shard(model, stage=stage)
        opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
    for step in range(steps):
        x, y = cases.batch("gpt", step)
        loss(kind, net, x, y).backward()
        if seen is not None and step == steps - 1:
            opt.register_step_pre_hook(lambda o, a, k: seen.append(net.memory(o)))
        opt.step()
        opt.zero_grad()
    return net, opt


def planned(kind: str, config) -> dict:
    """The planner's figures for this LoRA model (``zeroshard plan --lora``)."""
    from zeroshard.plan.adaptercount import with_lora
    from zeroshard.plan.arch import Architecture, ModelSpec
    from zeroshard.plan.memory import model_state_bytes
    from zeroshard.spec.dims import ParallelDims
    from zeroshard.spec.lora import LoraSpec
    from zeroshard.train.hfmodel import gpt_architecture

    arch = (Architecture("tiny-llama", 16, 3, 2, 24, 32, kv_heads=1) if kind == "llama"
            else gpt_architecture(cases.GPT_SMALL))
    spec = with_lora(ModelSpec.from_arch(arch), LoraSpec(RANK, targets=tuple(TARGETS[kind])))
    return {"params": spec.params, "trainable": spec.trainable,
            "state": model_state_bytes(spec.params, ParallelDims(dist.get_world_size()),
                                       config, spec.trainable)}


def lora_grid(folder: str, steps: int = 20) -> dict:
    """Per model and stage: adapters against DDP's, the base unchanged, memory against
    the plan, and save_pretrained read back by peft's from_pretrained."""
    import peft

    out = {}
    probe = cases.batch("gpt", 99)[0]
    for kind in ("llama", "gpt"):
        initial = build(kind).state_dict()
        ddp, _ = train(kind, "ddp", steps)
        ddp_w = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
        with torch.no_grad():
            ref = logits(kind, ddp.module.eval(), probe)
        real = build(kind)
        counts = (sum(p.numel() for p in real.parameters()),
                  sum(p.numel() for p in real.parameters() if p.requires_grad))
        for stage in range(4):
            seen = []
            net, _ = train(kind, stage, steps, seen=seen)
            w = net.full_state_dict()
            adapters = [k for k in w if "lora_" in k]
            scale = max(ddp_w[k].abs().max().item() for k in adapters)
            where = f"{folder}/{kind}-{stage}"
            net.save_pretrained(where)
            dist.barrier()
            with torch.no_grad():
                back = peft.PeftModel.from_pretrained(base(kind), where).eval()
                read = (logits(kind, back, probe) - ref).abs().max().item()
            out[(kind, stage)] = {
                "adapters": max((w[k] - ddp_w[k]).abs().max().item() for k in adapters) / scale,
                "base_unchanged": all(torch.equal(w[k], initial[k]) for k in w
                                      if k not in adapters),
                "memory": seen[0], "plan": planned(kind, net.zero_config), "counts": counts,
                "saved_logits": read,
            }
    return out


def peft_calls_grid() -> dict:
    """Stage 3: merge_and_unload against DDP's merged logits, the sharded model left as
    it was; adapters added or switched after sharding, refused; modules_to_save trained
    and saved; a quantized base refused."""
    import peft

    out = {}
    probe = cases.batch("gpt", 99)[0]
    ddp, _ = train("llama", "ddp", 3)
    with torch.no_grad():
        ref = logits("llama", ddp.module.eval(), probe)
    net, _ = train("llama", 3, 3)
    before = net.full_state_dict()
    merged = net.merge_and_unload()
    with torch.no_grad():
        out["merged_logits"] = (logits("llama", merged.eval(), probe) - ref).abs().max().item()
    out["merged_type"] = type(merged).__name__
    out["unchanged"] = cases.bit_equal(net.full_state_dict(), before)
    out["trains_on"] = torch.isfinite(loss("llama", net, *cases.batch("gpt", 5))).item()

    attempt = functools.partial(cases.refusal, out)

    config = peft.LoraConfig(r=RANK, target_modules=["q_proj"])
    attempt("add_adapter", lambda: net.add_adapter("late", config))
    two = build("llama")
    two.add_adapter("other", config)
    sharded = zs.shard(two, stage=3)
    attempt("set_adapter", lambda: sharded.set_adapter("other"))
    attempt("set_adapter_inference", lambda: sharded.set_adapter("other", inference_mode=True))
    with torch.no_grad():  # the other adapter (B at zero): the base's own logits
        plain = logits("llama", base("llama").eval(), probe)
        out["other_logits"] = (logits("llama", sharded.eval(), probe) - plain).abs().max().item()
    # modules_to_save: a trainable copy of the head, trained and saved like the adapters
    ddp, _ = train("llama", "ddp", 3, build("llama", modules_to_save=["lm_head"]))
    net, _ = train("llama", 3, 3, build("llama", modules_to_save=["lm_head"]))
    w = net.full_state_dict()
    ddp_w = ddp.module.state_dict()
    out["modules_to_save"] = max((w[k] - ddp_w[k]).abs().max().item() for k in w
                                 if "modules_to_save" in k)

    class Params4bit(nn.Parameter):  # bitsandbytes' class, by name
        pass

    quantized = base("llama")
    quantized.lm_head.weight = Params4bit(quantized.lm_head.weight.data, requires_grad=False)
    attempt("quantized", lambda: zs.shard(quantized, stage=3))
    return out
