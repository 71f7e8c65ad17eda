"""The shared library of the multi-process engine tests: models, batches, the DDP
reference trainer, and the grids that each feature file's one spawn runs on every rank
(importable by name, so the spawned ranks can unpickle them)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# bound before any model is sharded in the process, as at the top of a user's script
from torch.nn.utils import clip_grad_norm_ as early_clip_grad_norm_

import zeroshard as zs
from zeroshard.models.gpt import GPT, GPTConfig

GLOBAL_BATCH = 12
TOL = 1e-6  # against DDP: max abs difference relative to max |w|


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return x + torch.tanh(self.norm(self.fc(x)))


class MLP(nn.Module):
    """Input layer and head in the root unit, three repeated blocks as units."""

    def __init__(self, width: int = 12, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 2)

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return F.mse_loss(self.head(h), y)


class Branchy(nn.Module):
    """A branch only rank 0 takes, a branch nobody takes, and a frozen parameter."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(Block(8) for _ in range(2))
        self.rank0_only = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.frozen = nn.Parameter(torch.ones(8), requires_grad=False)
        self.head = nn.Linear(8, 2)

    def forward(self, x, y):
        h = self.inp(x) * self.frozen
        for b in self.blocks:
            h = b(h)
        if dist.get_rank() == 0:
            h = h + self.rank0_only(h)
        return F.mse_loss(self.head(h), y)


GPT_SMALL = GPTConfig(vocab=32, block_size=8, layers=3, heads=2, hidden=16)


class SkipGPT(GPT):
    """Block 1 is skipped (by every rank) on odd steps: its parameters go unused."""

    skip = False

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for k, block in enumerate(self.blocks):
            if not (self.skip and k == 1):
                x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class ReorderGPT(GPT):
    """Runs its blocks in reverse order on odd steps: the execution order changes."""

    skip = False  # set by the loop on odd steps

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for block in (reversed(self.blocks) if self.skip else self.blocks):
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class HFLoss(nn.Module):
    """A Hugging Face causal LM called the way the loop calls every model."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, x, y):
        return self.lm(input_ids=x, labels=x, use_cache=False).loss


def _hf(kind: str) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=3, n_head=2,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0)
        return HFLoss(transformers.GPT2LMHeadModel(cfg))
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24,
                                   num_hidden_layers=3, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=8,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return HFLoss(transformers.LlamaForCausalLM(cfg))


def build(name: str) -> nn.Module:
    torch.manual_seed(1234)
    if name == "gpt_ckpt":
        return GPT(GPTConfig(**{**GPT_SMALL.__dict__, "checkpointing": True}))
    if name == "gpt_reorder":
        return ReorderGPT(GPT_SMALL)
    if name == "gpt_frozen_skip":
        m = SkipGPT(GPT_SMALL)
        m.wpe.weight.requires_grad_(False)
        return m
    if name in ("hf_gpt2", "hf_llama"):
        return _hf(name[3:])
    if name == "mlp":
        return MLP()
    if name == "mlp_odd":  # dims that do not divide by 3 or 4: padding appears
        return MLP(width=7)
    if name in ("gpt", "gpt_tied_units", "gpt_persist"):
        return GPT(GPT_SMALL)
    if name == "branchy":
        return Branchy()
    raise AssertionError(name)


def batch(name: str, step: int, micro: int = 0, micros: int = 1, rank=None, world=None):
    """This rank's slice of the global batch for a step (same for every implementation)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    if rank is None:
        rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // world // micros
    if name.startswith(("gpt", "hf")):  # arithmetic sequences mod 32: learnable
        start = torch.randint(0, 32, (GLOBAL_BATCH, 1), generator=g)
        stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
        seq = (start + stride * torch.arange(9)) % 32
        data = (seq[:, :-1], seq[:, 1:])
    else:
        data = (torch.randn(GLOBAL_BATCH, 6, generator=g),
                torch.randn(GLOBAL_BATCH, 2, generator=g))
    base = rank * (GLOBAL_BATCH // world) + micro * per
    return tuple(t[base:base + per] for t in data)


def make_optimizer(kind: str, named, lr: float = 1e-2):
    named = list(named)
    params = [p for _, p in named]
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    if kind == "groups":  # nanoGPT: decay matrices, not biases and norms
        return torch.optim.AdamW([
            {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}], lr=lr)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=5e-2, momentum=0.9)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=5e-2)
    if kind == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-3)
    raise AssertionError(kind)


def train(model_name: str, stage, steps: int = 20, optim: str = "adamw", clip: float | None = None,
          micros: int = 1, precision=None, use_no_sync: bool = False,
          ddp_sync_every: bool = False, shard_group=None, bucket: int | None = None):
    """Train with zeroshard (stage 0-3) or torch DDP (stage "ddp"); return the full
    weights, the losses, and for zeroshard the model and optimizer. ``bucket``: the
    ``reduce_bucket_size`` (None: the stage's default; 0 at stage 0 reduces unit by unit
    as stages 1-3 do, so that at N >= 3 they sum in the same order)."""
    model = build(model_name)
    # nanoGPT-like; 1e-2 makes the tiny transformers chaotic
    lr = 1e-3 if model_name.startswith(("gpt", "hf")) else 1e-2
    if stage == "ddp":
        net = nn.parallel.DistributedDataParallel(
            model, find_unused_parameters=model_name == "gpt_frozen_skip")
        opt = make_optimizer(optim, [(n, p) for n, p in model.named_parameters()
                                     if p.requires_grad], lr)
    else:
        units = ([model.wte, model.head, *model.blocks] if model_name == "gpt_tied_units"
                 else "blocks")
        net = zs.shard(model, stage=stage, mixed_precision=precision, units=units,
                       shard_group=shard_group,
                       config={"param_persistence_threshold":
                               100 if model_name == "gpt_persist" else 0,
                               "reduce_bucket_size": bucket})
        opt = make_optimizer(optim, net.named_parameters(), lr)
    losses = []
    for step in range(steps):
        model.skip = step % 2 == 1
        total = 0.0
        for micro in range(micros):
            x, y = batch(model_name, step, micro, micros)
            last = micro == micros - 1
            skip = use_no_sync or (stage == "ddp" and not ddp_sync_every)
            ctx = net.no_sync() if skip and not last else _null()
            with ctx:
                loss = net(x, y) / micros
                loss.backward()
            total += loss.item()
        losses.append(total)
        if clip is not None:
            if stage == "ddp":
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            else:
                net.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
    weights = ({k: v.detach().clone() for k, v in model.state_dict().items()} if stage == "ddp"
               else net.full_state_dict())
    return weights, losses, (None if stage == "ddp" else net), opt


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def max_rel_diff(a: dict, b: dict) -> float:
    scale = max(v.abs().max().item() for v in b.values() if v.is_floating_point())
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b) / scale


def bit_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


# -- grids: each feature file's one spawn runs those it asserts; plain results for the parent

VARIANTS = {
    "plain": {},
    "clip": {"clip": 0.05},  # small enough that every step clips
    "accum": {"micros": 2},
    "groups": {"optim": "groups"},
    "sgd": {"optim": "sgd"},
    "adagrad": {"optim": "adagrad"},
    "rmsprop": {"optim": "rmsprop"},
}


def parity_grid(models, variants, steps=20):
    """For each model and variant: max relative difference of each stage to stage 0 and
    to DDP, and whether stages agree bit for bit."""
    out = {}
    for model in models:
        for variant in variants:
            kw = VARIANTS[variant]
            ref, _, _, _ = train(model, "ddp", steps, **kw)
            # stage 0 unit by unit, as stages 1-3 reduce; its default (DDP's bucket)
            # apart: at N >= 3 a buffer of another size sums in another order
            runs = {s: train(model, s, steps, bucket=0, **kw)[0] for s in range(4)}
            bucketed = train(model, 0, steps, **kw)[0]
            every = None
            if kw.get("micros", 1) > 1:  # DDP itself, reducing every micro-batch
                every = train(model, "ddp", steps, ddp_sync_every=True, **kw)[0]
            out[(model, variant)] = {
                "ddp_reorder": every and max_rel_diff(every, ref),
                "diff_to_ddp_every": every and [max_rel_diff(runs[s], every) for s in range(4)],
                "bit_equal_to_stage0": [bit_equal(runs[s], runs[0]) for s in range(4)],
                "diff_to_stage0": [max_rel_diff(runs[s], runs[0]) for s in range(4)],
                "diff_to_ddp": [max_rel_diff(runs[s], ref) for s in range(4)],
                "bucketed_to_stage0": max_rel_diff(bucketed, runs[0]),
                "bucketed_bit_equal": bit_equal(bucketed, runs[0]),
                "bucketed_to_ddp": max_rel_diff(bucketed, ref),
            }
    return out


def clip_norms(model_name):
    """(our global norm, torch's clip_grad_norm_ on DDP, the inf norms, torch's own
    clip_grad_norm_ on the shards bound before the first zs.shard, the shards' clipped
    gradients' largest difference between the two ways) after one backward, per
    stage."""
    out = []
    for stage in range(4):
        x, y = batch(model_name, 0)
        ref = build(model_name)
        ddp = nn.parallel.DistributedDataParallel(ref)
        ddp(x, y).backward()
        torch_inf = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, float("inf")).item()
        torch_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item()
        clipped = []
        for clip in (lambda m: m.clip_grad_norm_(0.05),
                     lambda m: early_clip_grad_norm_(m.parameters(), 0.05)):
            net = zs.shard(build(model_name), stage=stage)
            net(x, y).backward()
            inf = net.clip_grad_norm_(1e9, float("inf")).item()
            norm = clip(net).item()
            clipped.append((norm, [p.grad.clone() for p in net.parameters()]))
        gap = max((a - b).abs().max().item() for a, b in zip(clipped[0][1], clipped[1][1]))
        out.append((clipped[0][0], torch_norm, inf, torch_inf, clipped[1][0], gap))
    return out


def bf16_grid(steps=20):
    _, ref_losses, _, _ = train("gpt", 0, steps)
    runs = {s: train("gpt", s, steps, precision="bf16") for s in range(4)}
    return {
        "bit_equal_to_stage0": [bit_equal(runs[s][0], runs[0][0]) for s in range(4)],
        "loss_gap": max(abs(a - b) for s in range(4) for a, b in zip(runs[s][1], ref_losses)),
        "loss_first_last": (runs[3][1][0], runs[3][1][-1]),
    }


def ledger_grid(model="mlp"):
    """Memory per category between a backward and its step (the optimizer state made by
    a first step), and bytes sent in one (unclipped) step."""
    from zeroshard.plan.memory import comm_bytes, model_state_bytes
    from zeroshard.spec.dims import ParallelDims

    out = {}
    for precision in (None, "bf16"):
        for stage in range(4):
            _, _, net, opt = train(model, stage, steps=1, precision=precision)
            params = sum(p.numel() for p in build(model).parameters())
            recipe = net.zero_config.recipe
            net.comm_stats(reset=True)
            x, y = batch(model, 1)
            net(x, y).backward()
            # read once the engine's step pre-hook has landed every gradient
            seen = []
            hook = opt.register_step_pre_hook(
                lambda o, a, k, seen=seen, net=net: seen.append(net.memory(o)))
            opt.step()
            hook.remove()
            mem = seen[0]
            opt.zero_grad()
            flags = sum(len(u.trainable) for u in net.units)
            out[(precision, stage)] = {
                "memory": mem,
                "plan": model_state_bytes(params, ParallelDims(dist.get_world_size()),
                                          net.zero_config),
                "params": params,
                "bytes": {"params": recipe.weight_bytes, "grads": recipe.grad_bytes,
                          "optimizer": recipe.optimizer_bytes},
                "comm": net.comm_stats(),
                "comm_plan": comm_bytes(params, ParallelDims(dist.get_world_size()),
                                        net.zero_config),
                "flag_bytes": flags * recipe.reduce_bytes,
            }
    return out


def unused_frozen_grid():
    """Per stage: a branch nobody takes, a frozen parameter and a branch only rank 0 takes,
    after three steps; and the untaken branch again under two synchronised micro-batches."""
    out = {}
    for stage in range(4):
        before = {k: v.clone() for k, v in build("branchy").state_dict().items()}
        w, losses, net, _ = train("branchy", stage, steps=3)
        out[stage] = {
            "never_changed": torch.equal(w["never.weight"], before["never.weight"]),
            "frozen_changed": not torch.equal(w["frozen"], before["frozen"]),
            "rank0_only_changed": not torch.equal(w["rank0_only.weight"],
                                                  before["rank0_only.weight"]),
            "weights": w,
            # two micro-batches, both synchronised: a parameter no rank used must still
            # get no gradient, so weight decay leaves it alone
            "never_changed_accum": torch.equal(train("branchy", stage, steps=2, micros=2)[0][
                "never.weight"], before["never.weight"]),
        }
    return out


def no_sync_grid():
    """Per stage: the weights' difference with and without ``no_sync`` on the first of two
    micro-batches."""
    out = {}
    for stage in range(4):
        plain = train("mlp", stage, steps=4, micros=2)[0]
        synced = train("mlp", stage, steps=4, micros=2, use_no_sync=True)[0]
        out[stage] = max_rel_diff(synced, plain)
    return out


class Shampoo(torch.optim.Optimizer):
    """A third-party optimizer whose update needs whole matrices, built inside its own
    step where the engine cannot supply them (its step does nothing here)."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        return None


def grad_sync_flag_grid():
    """Per stage: nanoGPT's accumulation, torch DDP's ``require_backward_grad_sync`` set
    False on all but the last micro-step, against ``no_sync()`` on the same steps and
    against syncing every micro-step: (weights bit-equal to no_sync's, collectives per
    step with the flag, with no_sync, syncing every one)."""
    out = {}
    for stage in range(4):
        runs = {}
        for how in ("flag", "no_sync", "every"):
            net = zs.shard(build("gpt"), stage=stage)
            opt = make_optimizer("adamw", net.named_parameters(), 1e-3)
            for step in range(3):
                for micro in range(2):
                    last = micro == 1
                    if how == "flag":
                        net.require_backward_grad_sync = last
                    x, y = batch("gpt", step, micro, 2)
                    with net.no_sync() if how == "no_sync" and not last else _null():
                        (net(x, y) / 2).backward()
                opt.step()
                opt.zero_grad()
            calls = sum(v["calls"] for k, v in net.comm_stats().items() if k != "check") / 3
            runs[how] = (net.full_state_dict(), calls)
        out[stage] = {"bit_equal": bit_equal(runs["flag"][0], runs["no_sync"][0]),
                      "calls": tuple(runs[h][1] for h in ("flag", "no_sync", "every"))}
    return out


def refusal_grid():
    """Per (stage, optimizer): the error of an optimizer that cannot step shards, or None."""
    out = {}
    for stage, opt_cls in ((1, "Shampoo"), (2, "LBFGS"), (3, "Shampoo"), (0, "Shampoo")):
        net = zs.shard(build("mlp"), stage=stage)
        cls = Shampoo if opt_cls == "Shampoo" else getattr(torch.optim, opt_cls)
        opt = cls(net.parameters(), lr=1e-2)
        x, y = batch("mlp", 0)
        net(x, y).backward()
        try:
            closure = (lambda net=net, x=x, y=y: net(x, y)) if opt_cls == "LBFGS" else None
            opt.step(closure)
            out[(stage, opt_cls)] = None
        except ValueError as exc:
            out[(stage, opt_cls)] = str(exc)
    return out


def bf16_stage0_buffers():
    """Stage 0, bf16 gradients summed in fp32: the reductions in flight during backward are
    bounded (two), or their fp32 buffers would outweigh the bf16 gradients they carry.
    (most buffer bytes during backward, the widest unit's fp32 buffer, units)"""
    net = zs.shard(build("mlp"), stage=0, mixed_precision="bf16")

    class Peak:  # a listener of the engine's events: buffers as each unit finishes backward
        most = 0

        def event(self, kind, unit=None, **info):
            if kind == "backward_end":
                Peak.most = max(Peak.most, net.memory()["buffers"])

    net.events.subscribe(Peak())
    x, y = batch("mlp", 0)
    net(x, y).backward()
    widest = max((u.r_layout.slot_numel + len(u.trainable)) * u.comm.mesh.dp_world * 4
                 for u in net.units)
    return Peak.most, widest, len(net.units)


def broadcast_from_rank0():
    """Rank-dependent weights and buffer: sharding makes every rank start from rank 0's."""
    torch.manual_seed(1234 + dist.get_rank())
    mine = MLP()
    mine.register_buffer("scale", torch.full((3,), float(dist.get_rank())))
    reference = build("mlp").state_dict()
    reference["scale"] = torch.zeros(3)
    return bit_equal(zs.shard(mine, stage=3).full_state_dict(), reference)


def mismatched_models():
    """The error when rank 1's model differs from rank 0's, or None."""
    other = build("mlp") if dist.get_rank() == 0 else MLP(width=10)
    try:
        zs.shard(other, stage=2)
        return None
    except ValueError as exc:
        return str(exc)


def refusal(out: dict, key: str, fn) -> None:
    """``out[key]``: None where ``fn()`` returns, else the (class, message) of the
    ValueError or NotImplementedError it raised."""
    try:
        fn()
        out[key] = None
    except (ValueError, NotImplementedError) as exc:
        out[key] = (type(exc).__name__, str(exc))


def misuse_grid():
    """The step cycle misused: each a clear error on every rank, never a hang."""
    out = {}

    attempt = functools.partial(refusal, out)

    net = zs.shard(build("mlp"), stage=3)
    attempt("shard_twice", lambda: zs.shard(net, stage=2))
    attempt("shard_inside", lambda: zs.shard(nn.Sequential(net), stage=1))
    for stage in (0, 3):
        net = zs.shard(build("mlp"), stage=stage)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        x, y = batch("mlp", 0)

        def step_in_backward(net=net, opt=opt, x=x, y=y):
            loss = net(x, y)
            loss.register_hook(lambda g: opt.step())
            loss.backward()

        attempt(("step_in_backward", stage), step_in_backward)
        net = zs.shard(build("mlp"), stage=stage)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def backward_in_step(net=net, opt=opt, x=x, y=y):
            net(x, y).backward()

            def closure():
                loss = net(x, y)
                loss.backward()
                return loss
            opt.step(closure)

        attempt(("backward_in_step", stage), backward_in_step)
        net = zs.shard(build("mlp"), stage=stage, mixed_precision="bf16")
        decay = [p for p in net.parameters() if p.dim() >= 2]
        rest = [p for p in net.parameters() if p.dim() < 2]
        opts = [torch.optim.AdamW(decay, lr=0.1), torch.optim.SGD(rest, lr=0.1)]

        def two_optimizers(net=net, opts=opts, x=x, y=y):
            net(x, y).backward()
            for o in opts:
                o.step()

        attempt(("disjoint_optimizers", stage), two_optimizers)  # one cycle, two steps
        opts = [torch.optim.AdamW(decay + rest, lr=0.1), torch.optim.SGD(rest, lr=0.1)]
        attempt(("two_optimizers", stage), lambda opts=opts: two_optimizers(opts=opts))
        # the ordinary loop still runs after the refusal of the second optimizer
        net(x, y).backward()
        opts[0].step()
        net.zero_grad()
        out[("after_refusal", stage)] = net.cycle.state.value
    return out


def collectives_grid():
    """The engine's reduce-scatter and all-gather (on gloo: a pairwise exchange at two
    ranks, else an all-reduce in place, and N broadcasts, ``runtime/collectives.py``)
    against torch's own, bit for bit, over the whole world and over two halves of it;
    then stages 0-3 trained over the halves."""
    from zeroshard.runtime import collectives
    from zeroshard.runtime.collectives import Collectives
    from zeroshard.runtime.ledger import Ledger
    from zeroshard.runtime.mesh import Mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    # a group of the halves' first ranks: members of one half now belong to different
    # numbers of groups, which torch's group names count
    dist.new_group([0, world // 2])
    halves = [dist.new_group(list(range(k, k + world // 2))) for k in (0, world // 2)]
    mine = halves[rank // (world // 2)]
    out = {}
    for name, group, broadcast_max in (("world", None, 4), ("half", mine, 4),
                                       ("world_all_gather", None, 1),
                                       ("world_explicit", dist.group.WORLD, 4)):
        # broadcast_max 1: the all-gather above GLOO_BROADCAST_MAX ranks (torch's own)
        collectives.GLOO_BROADCAST_MAX = broadcast_max
        comm = Collectives(Ledger(), Mesh.build(group))
        n, r = comm.mesh.dp_world, comm.mesh.dp_rank
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(7 + rank)
            inp = torch.randn(n * 1001, generator=g).to(dtype)  # 1D [N·S], odd S
            ref = torch.empty(1001, dtype=dtype)
            dist.reduce_scatter_tensor(ref, inp.clone(), group=group)
            got = torch.empty(1001, dtype=dtype)
            comm.trace = []  # profiling: the record of the first wait must stand
            sent = inp.clone()
            work = comm.reduce_scatter(got, sent, async_op=True)
            work.wait()
            # two ranks exchange slots (the other slot of the input is left as it was:
            # half an all-reduce's bytes); more sum the whole input in place
            other = (r + 1) % n
            untouched = torch.equal(sent.view(n, -1)[other], inp.view(n, -1)[other])
            got_once, done = got.clone(), comm.trace[0]["done"]
            work.wait()  # a bucket's units each wait: the result must not change
            traced = comm.trace[0]["done"] == done
            comm.trace = None
            averaged = torch.empty(1001, dtype=dtype)
            comm.reduce_scatter(averaged, inp.clone(), mean=True, async_op=True).wait()
            shard = torch.randn(999, generator=g).to(dtype)
            ref_g = torch.empty(n * 999, dtype=dtype)
            dist.all_gather_into_tensor(ref_g, shard, group=group)
            gathered = torch.empty(n, 999, dtype=dtype)
            comm.all_gather(gathered, shard)
            inplace = torch.empty(n, 999, dtype=dtype)
            inplace[r].copy_(shard)
            comm.all_gather(inplace, inplace[r], async_op=True).wait()
            out[(name, str(dtype))] = {
                "reduce_scatter": torch.equal(got_once, ref) and torch.equal(got, ref),
                "pairwise_at_two": untouched == (n == 2),
                "traced_once": traced,
                "mean": torch.equal(averaged, ref / n),  # the same bits as dividing after
                "all_gather": torch.equal(gathered.view(-1), ref_g),
                "in_place": torch.equal(inplace.view(-1), ref_g),
            }
        out[(name, "ledger")] = comm.ledger.comm_stats()
    collectives.GLOO_BROADCAST_MAX = 4
    # Each half trains the MLP on the same batches: its stages agree bit for bit, and
    # so do the two halves.
    half_rank, half_world = dist.get_rank(mine), dist.get_world_size(mine)
    weights = []
    for stage in range(4):
        net = zs.shard(build("mlp"), stage=stage, group=mine)
        opt = make_optimizer("adamw", net.named_parameters())
        for step in range(3):
            x, y = batch("mlp", step, rank=half_rank, world=half_world)
            net(x, y).backward()
            opt.step()
            opt.zero_grad()
        weights.append(net.full_state_dict())
    others = [None] * world
    dist.all_gather_object(others, weights[0])
    out["half_training"] = {
        "stages_bit_equal": all(bit_equal(w, weights[0]) for w in weights),
        "halves_bit_equal": bit_equal(others[0], others[-1]),
    }
    return out


def freed_when_dropped():
    """Per (stage, profile): whether a sharded model that trained a step, a unit, the
    collectives holding its process groups (torch's registry keeps the groups until
    they are destroyed) and its hooks on the module's parameters are gone once the
    caller drops the model and its optimizer."""
    import gc
    import weakref

    out = {}
    for stage in range(4):
        for profile in (False, True):
            net = zs.shard(build("gpt"), stage=stage, profile=profile)
            opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
            x, y = batch("gpt", 0)
            net(x, y).backward()
            opt.step()
            refs = [weakref.ref(net), weakref.ref(net.units[0]), weakref.ref(net.units[0].comm)]
            param = next(p for p in net.module.parameters() if p.requires_grad)
            del net, opt
            gc.collect()
            hooks = getattr(param, "_post_accumulate_grad_hooks", None) or {}
            out[(stage, profile)] = [r() is None for r in refs] + [len(hooks) == 0]
    return out


def persistence_grid():
    """Stage 3 with biases and norms (< 100 elements) kept whole: what each rank holds."""
    net = zs.shard(build("gpt_persist"), stage=3, param_persistence_threshold=100)
    small = sum(p.numel() for p in build("gpt").parameters() if p.numel() < 100)
    big = sum(p.numel() for p in build("gpt").parameters() if p.numel() >= 100)
    x, y = batch("gpt", 0)
    net(x, y).backward()
    calls = net.comm_stats()["all_gather"]["calls"]
    # read once the engine's step pre-hook has landed every reduction
    opt, seen = torch.optim.SGD(net.parameters(), lr=0.0), []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(net.memory()))
    opt.step()
    return {"memory": seen[0], "small": small, "big": big, "gathers": calls,
            "units": len(net.units)}


def prefetch_grid():
    """States of block 2's unit when block 1 starts, per prefetch depth; and weights."""
    out = {"reorder": {}}
    for depth in (0, 1):  # the order changes every step: prefetch must not change results
        net = zs.shard(build("gpt_reorder"), stage=3, prefetch=depth)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        for step in range(4):
            net.module.skip = step % 2 == 1
            x, y = batch("gpt", step)
            net(x, y).backward()
            opt.step()
            opt.zero_grad()
        out["reorder"][depth] = net.full_state_dict()
    for depth in (0, 1, 2):
        net = zs.shard(build("gpt_ckpt"), stage=3, prefetch=depth)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        seen = []
        blocks = net.module.blocks
        blocks[1].register_forward_pre_hook(
            lambda m, a, net=net, seen=seen: seen.append((net.units[3].state.value,
                                                          net.units[1].state.value)))
        for step in range(3):
            x, y = batch("gpt", step)
            net(x, y).backward()
            opt.step()
            opt.zero_grad()
        out[depth] = {"seen": seen, "weights": net.full_state_dict(),
                      "gathers": net.comm_stats()["all_gather"]["calls"]}
    return out


def bucket_grid():
    """Weights after 3 steps and reductions per step, one collective per unit or one
    bucket for the whole model, per stage."""
    out = {}
    for stage in range(4):
        for size in (0, 10**9):
            net = zs.shard(build("gpt"), stage=stage, reduce_bucket_size=size)
            opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
            for step in range(3):
                x, y = batch("gpt", step)
                net(x, y).backward()
                opt.step()
                opt.zero_grad()
            kind = "all_reduce" if stage == 0 else "reduce_scatter"
            out[(stage, size)] = (net.full_state_dict(), net.comm_stats()[kind]["calls"] / 3)
    return out
