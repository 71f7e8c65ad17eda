"""The sharded side of a parity check: a trial's K steps on N ranks through ``zs.shard``,
each rank on its rows of every global batch, exactly as a training loop runs them.

Rank 0 returns what the comparison needs: the initial weights (``full_state_dict``),
the gradients of step 1 gathered from every rank's rows, every rank's losses, and the
weights and optimizer state after K steps read back whole from a checkpoint the ranks
save (``zs.save``: the format that records which rows each rank holds, so the state is
read as the optimizer holds it, at any stage); with the ledger's bytes by category and
the collectives' bytes per step, for the report beside the planner's.
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist

from ..runtime.unit import local
from .outcome import Outcome, optimizers_of, read_checkpoint
from .reference import quiet_dropout
from .trial import Trial, on_device, rows_of


def _grad_rows(model) -> dict:
    """This rank's rows of every reduced gradient: name -> (tp rank, first row of its
    local slice, rows [r, ...], the entry's split) ([Note: checkpoints across tp
    degrees] in ``checkpoint/tplayout.py``: a tp rank holds a slice of dim d)."""
    from ..checkpoint.sharded import entries

    out = {}
    for e in entries(model):
        g = e.shard.grad
        if g is None or not e.count or (e.tp_rank and e.tp_dim is None):
            continue  # (a parameter tensor parallelism leaves whole: tp rank 0's)
        rows = g.detach().reshape(-1, e.row).float().cpu()
        split = (e.shape, e.tp_dim, e.local_shape)
        if rows.shape[0] == e.rows:  # a whole gradient (stage 0)
            out[e.name] = (e.tp_rank, 0, rows, split)
        else:  # this rank's rows of it, padding aside
            out[e.name] = (e.tp_rank, e.first, rows[:e.count], split)
    return out


def _gather_grads(model) -> dict | None:
    """Every rank's gradient rows joined on rank 0 (None elsewhere): each tp rank's
    local slice from its rows, then the slices joined on their dim."""
    mine = _grad_rows(model)
    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, every, dst=0)
    if every is None:
        return None
    pieces: dict[str, dict[int, dict[int, torch.Tensor]]] = {}
    splits = {}
    for part in every:
        for name, (t, first, rows, split) in part.items():
            pieces.setdefault(name, {}).setdefault(t, {})[first] = rows
            splits[name] = split
    out = {}
    for name, by_tp in pieces.items():
        shape, dim, local_shape = splits[name]
        slices = [torch.cat([rows[k] for k in sorted(rows)]).reshape(local_shape)
                  for _, rows in sorted(by_tp.items())]
        out[name] = slices[0].reshape(shape) if dim is None else torch.cat(slices, dim)
    return out


def _step_memory(model, optimizer, held: dict) -> None:
    """The ledger's bytes by category where every one is live: after backward, before
    the step (gradients held), and the optimizer's after it (a first step creates it)."""
    opts = optimizers_of(optimizer)
    opts[0].register_step_pre_hook(lambda o, a, k: held.update(model.memory(opt_arg(opts))))
    opts[-1].register_step_post_hook(
        lambda o, a, k: held.update(optimizer=model.memory(opt_arg(opts))["optimizer"]))


def _sharded(module, trial: Trial):
    """``zs.shard`` of the trial's model; beside tensor parallelism, first parallelized
    by its plan over the ``"tp"`` dim of a ``(dp, tp)`` mesh (as ``zeroshard train
    --tp`` does: ``train/hfmodel.py``)."""
    from ..api import shard

    if trial.tp == 1:
        return shard(module, config=trial.config)
    from ..models.tpplan import parallelize
    from ..runtime.mesh import tensor_parallel_mesh

    mesh = tensor_parallel_mesh(trial.tp, trial.config.shard_group)
    parallelize(module, mesh["tp"], trial.tp_plan(module))
    return shard(module, config=trial.config, mesh=mesh)


def opt_arg(opts: list):
    """``model.memory``'s optimizer argument: one optimizer, or the list."""
    return opts[0] if len(opts) == 1 else opts


def run_rank(trial: Trial) -> dict | None:
    """This rank's part (``runtime/spawn.py`` calls it on every rank); rank 0's result."""
    from ..checkpoint import save
    from ..runtime.dist import default_device

    rank, world, device = dist.get_rank(), dist.get_world_size(), default_device()
    torch.manual_seed(trial.seed)
    module = trial.build_model()
    quiet_dropout(module)
    module.train()
    model = _sharded(module, trial)
    optimizer = trial.build_optimizer(model)
    opts = optimizers_of(optimizer)
    schedules = trial.schedules(opts)
    initial = model.full_state_dict()
    held: dict = {}
    model.comm_stats(reset=True)
    outcome = Outcome(initial={n: initial[n].cpu() for n, _ in model.named_shards()})
    for k, batch in enumerate(trial.batches):
        dp_rank, dp_world = model.mesh.dp_rank, model.mesh.dp_world
        loss = trial.loss(model, on_device(rows_of(batch, dp_rank, dp_world), device))
        loss.backward()
        losses = [None] * world  # a tensor-parallel group's ranks share their rows
        dist.all_gather_object(losses, (dp_rank, model.mesh.tp_rank,
                                        loss.detach().float().cpu().reshape(())))
        outcome.losses.update({f"step {k + 1}, rank {r}": v for r, t, v in losses if not t})
        if k == 0:
            outcome.grads = _gather_grads(model) or {}
        if k == trial.steps - 1:
            _step_memory(model, optimizer, held)
        if trial.clip is not None:
            model.clip_grad_norm_(trial.clip)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for s in schedules:
            s.step()
    comm = model.comm_stats(reset=True)
    with tempfile.TemporaryDirectory(prefix="zeroshard-verify-") as tmp:
        shared = [tmp]
        dist.broadcast_object_list(shared, src=0)  # rank 0's folder, on one machine
        save(model, opt_arg(opts), f"{shared[0]}/ckpt")
        if rank:
            return None
        outcome.weights, outcome.state = read_checkpoint(f"{shared[0]}/ckpt")
    tp = model.mesh.tp_world  # the planner counts tp x a rank's (plan/tp.py)
    units = [tp * sum(local(p).numel() for p in u.params) for u in model.units]
    full = {id(shard): tuple(u.params[i].shape) for u in model.units
            for i, shard in enumerate(u.shards) if shard is not None}
    stepped = [[full[id(p)] for g in o.param_groups for p in g["params"] if id(p) in full]
               for o in opts]
    trainable = sum(u.params[i].numel() for u in model.units for i in u.trainable)
    return {"outcome": outcome, "memory": held, "comm": comm, "units": units,
            "trainable": trainable, "shapes": [tuple(p.shape) for u in model.units
                                               for p in u.params],
            "dims": model.mesh.dims, "steps": trial.steps, "stepped": stepped,
            "optimizers": [type(o).__name__ for o in opts]}
