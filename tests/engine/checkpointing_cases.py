"""The activation-checkpointing grids ``test_checkpointing.py``'s spawns run on every rank:
the built-in GPT, a Hugging Face Llama and GPT-2 (its dropout on: the recompute must draw
the same masks) trained at each stage under each mode, against the same run keeping
every activation; and the features a checkpointed unit meets: LoRA, ``model.compile()``,
tensor parallelism, offload, generation, a model that checkpoints itself."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zeroshard as zs
from zeroshard.models.gpt import GPT, get_preset

VOCAB, SEQ, ROWS = 48, 16, 2
MODES = ("none", "full", "selective", 2, "full+offload")
MODELS = ("gpt", "llama", "gpt2")


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(3)
    if name == "gpt":
        return GPT(get_preset("tiny"))
    import transformers

    transformers.logging.set_verbosity_error()
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64))  # dropout 0.1


def loss_of(name: str, net, ids: torch.Tensor) -> torch.Tensor:
    if name == "gpt":
        return net(ids, ids)
    return net(input_ids=ids, labels=ids).loss


def train(name: str, stage: int, mode, steps: int = 3, model=None, **options) -> dict:
    """Losses and full weights after ``steps`` AdamW steps on this rank's batches (the
    same for every run: a seeded generator per rank, and dropout's own seed)."""
    model = build(name) if model is None else model
    net = zs.shard(model, stage=stage, activation_checkpointing=mode, **options)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(50 + dist.get_rank())
    torch.manual_seed(7 + dist.get_rank())  # dropout's masks
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        out = loss_of(name, net, ids)
        out.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.item())
    return {"losses": losses, "weights": net.full_state_dict(),
            "wrapped": net.checkpointed_units}


def _same(a: dict, b: dict) -> dict:
    """Whether two runs' losses and weights are bit for bit the same, and how far apart."""
    diff = max((a["weights"][k].double() - b["weights"][k].double()).abs().max().item()
               for k in b["weights"])
    loss = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    exact = a["losses"] == b["losses"] and all(
        torch.equal(a["weights"][k], b["weights"][k]) for k in b["weights"])
    return {"exact": exact, "weights": diff, "loss": loss, "wrapped": a["wrapped"],
            "graphs": a.get("graphs")}


def parity_grid(models=MODELS, stages=(0, 3), bf16=True) -> dict:
    """{(model, stage, mode): comparison with the same stage keeping every activation}
    in fp32, and (``bf16``) under bf16 mixed precision for full and selective at stages
    0 and 3."""
    out = {}
    for name in models:
        for stage in stages:
            base = train(name, stage, "none")
            for mode in MODES[1:]:
                out[(name, stage, mode)] = _same(train(name, stage, mode), base)
        for stage in (0, 3) if bf16 else ():
            base = train(name, stage, "none", mixed_precision="bf16")
            for mode in ("full", "selective"):
                out[(name, stage, mode, "bf16")] = _same(
                    train(name, stage, mode, mixed_precision="bf16"), base)
    return out


def _lora(model):
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))


def _compiled_runs(mode) -> dict:
    """The Llama at stage 3 with ``model.compile()`` of each unit: its weights and how
    many compiled graphs ran (a checkpointed unit's compiled forward inside the
    checkpoint, run again by the recompute)."""
    import torch._dynamo

    from .compile_cases import counting

    torch._dynamo.reset()
    runs: list = []
    model = build("llama")
    net = zs.shard(model, stage=3, activation_checkpointing=mode)
    net.compile(backend=counting("aot_eager", runs))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(50 + dist.get_rank())
    losses = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        out = loss_of("llama", net, ids)
        out.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.item())
    return {"losses": losses, "weights": net.full_state_dict(),
            "wrapped": net.checkpointed_units, "graphs": len(runs)}


def _tp(mode) -> dict:
    """The Llama with tensor parallelism over both ranks (a 1 × 2 mesh) at stage 3."""
    from torch.distributed.device_mesh import init_device_mesh

    from zeroshard.models.tpplan import hf_plan, parallelize

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = build("llama")
    parallelize(model, mesh["tp"], hf_plan(model))
    net = zs.shard(model, stage=3, mesh=mesh, activation_checkpointing=mode)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(50)  # one batch: both ranks are one replica
    losses = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        logits = net(input_ids=ids, use_cache=False).logits
        out = F.cross_entropy(logits.float().reshape(-1, VOCAB), ids.reshape(-1))
        out.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.item())
    return {"losses": losses, "weights": net.full_state_dict(), "wrapped": net.checkpointed_units}


def _generated(mode) -> list:
    """Greedy tokens of GPT-2 at stage 3 after a step, generation running unwrapped."""
    model = build("gpt2")
    net = zs.shard(model, stage=3, activation_checkpointing=mode)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(5))
    loss_of("gpt2", net, ids).backward()
    opt.step()
    opt.zero_grad()
    net.eval()
    return net.generate(ids[:, :4], max_new_tokens=6, do_sample=False, pad_token_id=0).tolist()


def _checkpoints_itself(lora: bool) -> dict:
    """A Llama (or a peft LoRA of it) after transformers' checkpointing is enabled, asked
    for "full": kept as it is (one warning, no unit wrapped), trained as the run without."""
    model = build("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        model = _lora(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = train("llama", 3, "full", model=model)
    said = [str(w.message) for w in caught if "checkpoints itself" in str(w.message)]
    plain = _lora(build("llama")) if lora else build("llama")
    return {**_same(run, train("llama", 3, "none", model=plain)), "warned": said}


def features_grid(modes=("full", "selective")) -> dict:
    """Each feature beside checkpointing (in ``modes``) against the same run without it,
    and the models it leaves alone."""
    out = {}
    for mode in modes:
        out[("lora", mode)] = _same(train("llama", 3, mode, model=_lora(build("llama"))),
                                    train("llama", 3, "none", model=_lora(build("llama"))))
        out[("compile", mode)] = _same(_compiled_runs(mode), _compiled_runs("none"))
        out[("tp", mode)] = _same(_tp(mode), _tp("none"))
        out[("offload", mode)] = _same(train("gpt", 3, mode, offload="optimizer"),
                                       train("gpt", 3, "none", offload="optimizer"))
        out[("generate", mode)] = _generated(mode) == _generated("none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        whole = zs.shard(build("gpt"), stage=3, units=None, activation_checkpointing="full")
    out["one unit"] = (whole.checkpointed_units, [str(w.message) for w in caught])
    out["itself"] = _checkpoints_itself(lora=False)
    out["itself", "lora"] = _checkpoints_itself(lora=True)
    return out
