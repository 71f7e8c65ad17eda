"""The shared library of the tensor-parallel tests (``tests/engine/test_tp*.py``,
``tests/train/test_tp.py``): the tiny models, their batches, the meshes, and the runs
each spawned rank makes (importable by name, so the spawned ranks can unpickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zeroshard as zs
from zeroshard.models.gpt import GPT, GPTConfig
from zeroshard.models.tpplan import hf_plan, parallelize

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


#: SGD steps of the parity grid: a few at every stage and layout (the stages' agreement
#: and the distance show within them), and 20 at stage 3 on dp 2 × tp 2
SHORT, LONG = 3, 20


def grid_parity():
    """SGD at every stage and layout, both models, ``SHORT`` steps, and ``LONG`` steps at
    stage 3 on dp 2 × tp 2: each run's full weights, compared on rank 0 with one another
    (bit for bit) and with the one-process reference."""
    out = {}
    for name in ("gpt", "llama"):
        if dist.get_rank() == 0:
            out[name, "ref", SHORT] = reference(name, SHORT)
            out[name, "ref", LONG] = reference(name, LONG)
        runs = [(layout, stage, SHORT) for layout in LAYOUTS for stage in range(4)]
        for layout, stage, steps in runs + [("dp2tp2", 3, LONG)]:
            mesh = mesh_of(layout)
            model = tp_model(name, mesh, stage)
            train(name, model, mesh, steps)
            full = model.full_state_dict()
            if dist.get_rank() == 0:
                out[name, layout, stage, steps] = full
    return out if dist.get_rank() == 0 else None


#: (model, layout, precision) of the ledger grid, each at stages 0-3
LEDGER_CASES = [("gpt", "dp2tp2", None), ("gpt", "dp2tp2", "bf16"), ("llama", "dp2tp2", None),
                ("gpt", "hsdp2x1tp2", None)]


def grid_ledger():
    """Memory per category between a backward and its step (the optimizer state made by
    a first step), and bytes per level of one (unclipped) step, on every stage of each of
    :data:`LEDGER_CASES`; and the flags (presence flags per unit) the engine adds."""
    out = {}
    for name, layout, precision in LEDGER_CASES:
        mesh = mesh_of(layout)
        for stage in range(4):
            model = tp_model(name, mesh, stage, mixed_precision=precision)
            opt = make_optimizer("adamw", model.parameters(), 1e-3)
            x, y = batch(0)
            loss(name, model, rows(mesh, x), rows(mesh, y)).backward()
            opt.step()
            opt.zero_grad()
            model.comm_stats(reset=True)
            x, y = batch(1)
            loss(name, model, rows(mesh, x), rows(mesh, y)).backward()
            seen = []
            hook = opt.register_step_pre_hook(lambda o, a, k, seen=seen, m=model:
                                              seen.append(m.memory(o)))
            opt.step()
            hook.remove()
            opt.zero_grad()
            out[name, layout, precision, stage] = {
                "memory": seen[0], "levels": model.comm_stats(by_level=True),
                "flags": [len(u.trainable) for u in model.units], "config": model.zero_config,
                "tokens": rows(mesh, x).numel()}
    return out if dist.get_rank() == 0 else None


def fsdp2_tp(name: str, mesh):
    """The same model under FSDP2 + TP on the same mesh (torchtitan's composition:
    ``parallelize_module`` on the tp dim, then ``fully_shard`` per block and the root on
    the dp dim)."""
    from torch.distributed.fsdp import fully_shard

    model = build(name)
    parallelize(model, mesh["tp"], plan_of(name, model))
    blocks = model.blocks if name == "gpt" else model.model.layers
    for block in blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def clip_dtensors(params, max_norm: float) -> torch.Tensor:
    """Clipping for FSDP2 + TP, whose parameters sit on two meshes (torch's
    ``clip_grad_norm_`` refuses them): each gradient's norm made whole, then summed
    (torchtitan's ``clip_grad_norm_`` does the same per mesh)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    norms = [torch.linalg.vector_norm(g) for g in grads]
    total = torch.stack([n.full_tensor() if isinstance(n, DTensor) else n
                         for n in norms]).pow(2).sum().sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def adam_against_fsdp2(steps: int = 20, clip: float = 0.05, lr: float = 1e-2):
    """Clipped AdamW on dp 2 × tp 2, the GPT: zeroshard at stages 0 and 3 and FSDP2 + TP,
    each one's full weights; rank 0 adds the one-process reference and the clipped norms
    of the first step (that the clipping clips)."""
    mesh = mesh_of("dp2tp2")
    out = {}
    for stage in (0, 3):  # (every stage agrees bit for bit: the parity grid)
        model = tp_model("gpt", mesh, stage)
        train("gpt", model, mesh, steps, "adamw", clip, lr)
        out[stage] = model.full_state_dict()
    net = fsdp2_tp("gpt", mesh)
    train("gpt", net, mesh, steps, "adamw", clip, lr,
          clip_fn=lambda c: clip_dtensors(list(net.parameters()), c))
    out["fsdp2"] = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                    for k, v in net.state_dict().items()}
    if dist.get_rank() == 0:
        out["ref"] = reference("gpt", steps, "adamw", clip, lr)
    return out if dist.get_rank() == 0 else None


def nonfinite_in_one_slice(clip):
    """dp 2 × tp 2, the GPT, ``nonfinite="skip"``: at step 1 rank 1 (tp rank 1) alone puts a
    NaN in its rows of a column-parallel weight's gradient; every rank must skip that
    step (the weights before and after it equal on every rank) and take the next."""
    mesh = mesh_of("dp2tp2")
    model = tp_model("gpt", mesh, 3, nonfinite="skip")
    opt = make_optimizer("adamw", model.parameters(), 1e-2)
    shard = dict(model.named_shards())["blocks.0.q.weight"]
    out = []
    for step in range(3):
        x, y = batch(step)
        loss("gpt", model, rows(mesh, x), rows(mesh, y)).backward()
        model.synchronize()
        model.stepper.finalize_grads()
        if step == 1 and dist.get_rank() == 1:
            shard.grad.view(-1)[0] = float("nan")
        if clip is not None:
            model.clip_grad_norm_(clip)
        before = [s.detach().clone() for _, s in model.named_shards()]
        opt.step()
        opt.zero_grad()
        same = all(torch.equal(a, s) for a, (_, s) in zip(before, model.named_shards()))
        out.append((model.last_step_skipped, same))
    return out


def out_of_step_across_tp():
    """dp 2 × tp 2: tp rank 1 of data-parallel rank 0 (rank 1) alone clips; the ranks'
    fingerprints (their control group spans every rank of the mesh) stop every rank."""
    from zeroshard.runtime.watch import RanksOutOfStep

    mesh = mesh_of("dp2tp2")
    model = tp_model("gpt", mesh, 2)
    opt = make_optimizer("adamw", model.parameters(), 1e-2)
    x, y = batch(0)
    loss("gpt", model, rows(mesh, x), rows(mesh, y)).backward()
    try:
        if dist.get_rank() == 1:
            model.clip_grad_norm_(1.0)
        opt.step()
    except RanksOutOfStep as exc:
        return str(exc)
    return "not stopped"


def _trained(layout: str, stage: int, steps: int = 2):
    mesh = mesh_of(layout)
    model = tp_model("gpt", mesh, stage)
    opt = make_optimizer("adamw", model.parameters(), 1e-2)
    for step in range(steps):
        x, y = batch(step)
        loss("gpt", model, rows(mesh, x), rows(mesh, y)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def full_state(model, opt) -> dict:
    """The full weights and the full moments (the optimizer's state dict speaks DTensor,
    ``dtensor.py``): a collective."""
    names = [n for n, _ in model.named_shards()]
    moments = {f"{names[i]}::{k}": v.full_tensor()
               for i, state in sorted(opt.state_dict()["state"].items())
               for k, v in sorted(state.items()) if hasattr(v, "full_tensor")}
    return {**model.full_state_dict(), **moments}


def _loaded(layout: str, stage: int, path: str) -> dict:
    mesh = mesh_of(layout)
    model = tp_model("gpt", mesh, stage)
    opt = make_optimizer("adamw", model.parameters(), 1e-2)
    zs.load(model, opt, path)
    return full_state(model, opt)


def checkpoints(folder: str) -> dict:
    """zeroshard's checkpoints across tp degrees on 4 ranks: A saved at dp 2 × tp 2 (stage
    3) loaded at dp 4 (stage 1), tp 4 (stage 2) and dp 2 × tp 2 (stage 0); B saved at dp 4
    (stage 2) loaded at dp 2 × tp 2 (stage 3); A exported (rank 0) and the export loaded
    at dp 2 × tp 2 through ``zs.load_pretrained``. Full weights and moments of each."""
    from zeroshard.checkpoint.consolidated import export, load_pretrained

    out = {}
    model, opt = _trained("dp2tp2", 3)
    zs.save(model, opt, f"{folder}/a")
    out["a"] = full_state(model, opt)
    for layout, stage in (("dp4", 1), ("tp4", 2), ("dp2tp2", 0)):
        out["a", layout] = _loaded(layout, stage, f"{folder}/a")
    model, opt = _trained("dp4", 2)
    zs.save(model, opt, f"{folder}/b")
    out["b"] = full_state(model, opt)
    out["b", "dp2tp2"] = _loaded("dp2tp2", 3, f"{folder}/b")
    if dist.get_rank() == 0:
        export(f"{folder}/a", f"{folder}/a-export")
    dist.barrier()
    mesh = mesh_of("dp2tp2")
    plain = tp_model("gpt", mesh, 1)
    load_pretrained(plain, f"{folder}/a-export")
    out["export", "dp2tp2"] = plain.full_state_dict()
    return out


def dcp_across_tp(folder: str) -> dict:
    """``torch.distributed.checkpoint`` of the state dict (DTensors on the 2-D mesh) saved
    at dp 2 × tp 2 (stage 3) and loaded at tp 4 (stage 1) and at dp 4 without a mesh
    (stage 2): the full weights of each."""
    import torch.distributed.checkpoint as dcp

    out = {}
    model, _ = _trained("dp2tp2", 3)
    dcp.save(model.state_dict(), checkpoint_id=f"{folder}/dcp")
    out["saved"] = model.full_state_dict()
    for layout, stage in (("tp4", 1), (None, 2)):
        other = (tp_model("gpt", mesh_of(layout), stage) if layout else
                 zs.shard(build("gpt"), stage=stage))
        sd = other.state_dict()
        dcp.load(sd, checkpoint_id=f"{folder}/dcp")
        other.load_state_dict(sd)
        out[layout or "plain dp4"] = other.full_state_dict()
    return out


class TwoLinears(torch.nn.Module):
    def __init__(self, width: int = 6):
        super().__init__()
        self.up = torch.nn.Linear(width, width)
        self.down = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.down(self.up(x))


def errors() -> list[str]:
    """One line each: a mesh with other dims, a DTensor model given no mesh, a DTensor model
    on another mesh's tp dim, a tp degree that does not divide a split dim."""
    from torch.distributed.device_mesh import init_device_mesh

    def attempt(build_model, mesh):
        try:
            zs.shard(build_model(), stage=3, mesh=mesh)
            return "accepted"
        except ValueError as exc:
            return str(exc)

    mesh = mesh_of("dp2tp2")
    other = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "model"))

    def on(tp_mesh, width=8):
        def make():
            m = TwoLinears(width)
            return parallelize(m, tp_mesh, {"up": "colwise", "down": "rowwise"})
        return make

    return [attempt(on(mesh["tp"]), named), attempt(on(mesh["tp"]), None),
            attempt(on(mesh["tp"]), other), attempt(on(other["tp"], width=6), other)]


def features(folder: str) -> dict:
    """The 4-rank spawn of ``test_tp_features.py``: every rank's results."""
    out = {"adam": adam_against_fsdp2(),
           "nonfinite": {clip: nonfinite_in_one_slice(clip) for clip in (None, 1.0)},
           "checkpoints": checkpoints(folder), "dcp": dcp_across_tp(folder),
           "errors": errors(), "sp": sequence_parallel(), "view": module_view(),
           "other": other_features()}
    out["out_of_step"] = out_of_step_across_tp()  # last: it leaves the groups out of step
    return out


def two_ranks(folder: str) -> dict:
    """tp 2 × dp 1 on 2 ranks: checkpoint A (written at dp 2 × tp 2) loaded; C saved here
    (stage 2) and loaded at dp 2 without tensor parallelism (stage 3)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = tp_model("gpt", mesh, 2)
    opt = make_optimizer("adamw", model.parameters(), 1e-2)
    zs.load(model, opt, f"{folder}/a")
    out = {"a": full_state(model, opt)}
    zs.save(model, opt, f"{folder}/c")
    plain = zs.shard(build("gpt"), stage=3)
    opt = make_optimizer("adamw", plain.parameters(), 1e-2)
    zs.load(plain, opt, f"{folder}/c")
    out["c", "dp2"] = full_state(plain, opt)
    return out


class SPNet(torch.nn.Module):
    """A norm and an MLP under sequence parallelism: the norm on this rank's tokens
    (``SequenceParallel``: its replicated weight's gradient arrives ``Partial()``)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return self.down(torch.tanh(self.up(self.norm(x))))


def sequence_parallel(steps: int = 3) -> dict:
    """dp 2 × tp 2, SGD, stages 0 and 3: ``SequenceParallel`` norm, the MLP taking and
    giving sequence shards; each tp rank's loss is its tokens' share of the mean. The
    full weights of each stage and of the one-process reference."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = mesh_of("dp2tp2")
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(4, 8, 8, generator=g), torch.randn(4, 8, 8, generator=g)
    tp, t = mesh.size(1), mesh.get_local_rank("tp")
    out = {}
    for stage in (0, 3):
        torch.manual_seed(3)
        net = SPNet()
        parallelize_module(net, mesh["tp"], {
            "norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1))})
        model = zs.shard(net, stage=stage, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        xs, ys = (v.chunk(tp, dim=1)[t] for v in (rows(mesh, x), rows(mesh, y)))
        for _ in range(steps):
            mine = model(xs)  # this rank's tokens
            ((mine - ys) ** 2).sum().div(rows(mesh, y).numel()).backward()
            opt.step()
            opt.zero_grad()
        out[stage] = model.full_state_dict()
    if dist.get_rank() == 0:
        torch.manual_seed(3)
        ref = SPNet()
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for _ in range(steps):
            ((ref(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
        out["ref"] = {k: v.detach() for k, v in ref.state_dict().items()}
    return out


def module_view() -> dict:
    """dp 2 × tp 2 at stage 3, between steps: what the module shows of a released unit —
    DTensors on the 2-D mesh, whole again through ``full_tensor()`` — and the full
    weights to compare them with."""
    model, _ = _trained("dp2tp2", 3, steps=1)
    shown = dict(model.module.named_parameters())
    out = {name: (tuple(p.device_mesh.mesh_dim_names), str(p.placements))
           for name, p in shown.items() if name.startswith("blocks.0.")}
    out["whole"] = {name: p.full_tensor() for name, p in shown.items()}
    out["full"] = model.full_state_dict()
    return out


def _sgd_run(mesh, stage: int, steps: int = 3, micros: int = 1, **options) -> dict:
    """SGD on the GPT, ``micros`` accumulated micro-batches per step; its full weights."""
    model = tp_model("gpt", mesh, stage, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = (rows(mesh, t) for t in batch(step))
        for m in range(micros):
            part = slice(m * x.shape[0] // micros, (m + 1) * x.shape[0] // micros)
            (loss("gpt", model, x[part], y[part]) / micros).backward()
        opt.step()
        opt.zero_grad()
    return model.full_state_dict()


def other_features() -> dict:
    """dp 2 × tp 2, the GPT, 3 SGD steps: accumulation (2 micro-batches, stages 1 and 2),
    offload of the optimizer (stage 3), hpZ (a secondary group of 1 at stage 3, beside
    plain stage 3), qwZ + qgZ (stage 3), and the one-process reference (rank 0)."""
    mesh = mesh_of("dp2tp2")
    out = {("accum", s): _sgd_run(mesh, s, micros=2) for s in (1, 2)}
    out["offload"] = _sgd_run(mesh, 3, offload="optimizer")
    out["plain3"] = _sgd_run(mesh, 3)
    out["hpz"] = _sgd_run(mesh, 3, secondary_group=1)
    out["quantized"] = _sgd_run(mesh, 3, quantize_weights=True, quantize_grads=True,
                                quant_block=64)
    if dist.get_rank() == 0:
        out["ref"] = reference("gpt", 3)
    return out


def whole_tensor_optimizers_beside_tp() -> dict:
    """tp 2 at stages 0 and 3: Muon (whole matrices) and Adafactor (whole-tensor sums)
    refused at their first step, in one line; AdamW steps. Per (optimizer, stage): the
    error, or None."""
    from torch.distributed.device_mesh import init_device_mesh

    from zeroshard.optim.lamb import Lamb

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for stage in (0, 3):
        for name in ("Muon", "Adafactor", "Lamb", "AdamW"):
            model = tp_model("gpt", mesh, stage)
            params = [p for p in model.parameters() if p.dim() == 2] if name == "Muon" else \
                list(model.parameters())
            cls = Lamb if name == "Lamb" else getattr(torch.optim, name)
            opt = cls(params, lr=1e-3)
            x, y = batch(0)
            loss("gpt", model, rows(mesh, x), rows(mesh, y)).backward()
            try:
                opt.step()
                out[(name, stage)] = None
            except ValueError as exc:
                out[(name, stage)] = str(exc)
    return out
