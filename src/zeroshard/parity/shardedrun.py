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
    """This rank's rows of every reduced gradient: name -> (first row, rows [r, ...])."""
    from ..checkpoint.sharded import entries

    out = {}
    for e in entries(model):
        g = e.shard.grad
        if g is None or not e.count:
            continue
        full_rows = e.shape[0] if e.shape else 1
        rows = g.detach().reshape(-1, e.row).float().cpu()
        if rows.shape[0] == full_rows:  # a whole gradient (stage 0)
            out[e.name] = (0, rows, e.shape)
        else:  # this rank's rows of it, padding aside
            out[e.name] = (e.first, rows[:e.count], e.shape)
    return out


def _gather_grads(model) -> dict | None:
    """Every rank's gradient rows joined on rank 0 (None elsewhere): full tensors."""
    mine = _grad_rows(model)
    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, every, dst=0)
    if every is None:
        return None
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    shapes = {}
    for part in every:
        for name, (first, rows, shape) in part.items():
            pieces.setdefault(name, {})[first] = rows
            shapes[name] = shape
    return {name: torch.cat([p[k] for k in sorted(p)]).reshape(shapes[name])
            for name, p in pieces.items()}


def _step_memory(model, optimizer, held: dict) -> None:
    """The ledger's bytes by category where every one is live: after backward, before
    the step (gradients held), and the optimizer's after it (a first step creates it)."""
    opts = optimizers_of(optimizer)
    opts[0].register_step_pre_hook(lambda o, a, k: held.update(model.memory(opt_arg(opts))))
    opts[-1].register_step_post_hook(
        lambda o, a, k: held.update(optimizer=model.memory(opt_arg(opts))["optimizer"]))


def opt_arg(opts: list):
    """``model.memory``'s optimizer argument: one optimizer, or the list."""
    return opts[0] if len(opts) == 1 else opts


def run_rank(trial: Trial, folder: str | None = None) -> dict | None:
    """This rank's part (``runtime/spawn.py`` calls it on every rank); rank 0's result."""
    from ..api import shard
    from ..checkpoint import save
    from ..runtime.dist import default_device

    rank, world, device = dist.get_rank(), dist.get_world_size(), default_device()
    torch.manual_seed(trial.seed)
    module = trial.build_model()
    quiet_dropout(module)
    module.train()
    model = shard(module, config=trial.config)
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
        losses = [None] * world
        dist.all_gather_object(losses, loss.detach().float().cpu().reshape(()))
        outcome.losses.update({f"step {k + 1}, rank {r}": v for r, v in enumerate(losses)})
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
        path = folder or tmp
        shared = [path]
        dist.broadcast_object_list(shared, src=0)  # rank 0's folder, on one machine
        save(model, opt_arg(opts), f"{shared[0]}/ckpt")
        if rank:
            return None
        outcome.weights, outcome.state = read_checkpoint(f"{shared[0]}/ckpt")
    units = [sum(local(p).numel() for p in u.params) for u in model.units]
    full = {id(shard): tuple(local(u.params[i]).shape) for u in model.units
            for i, shard in enumerate(u.shards) if shard is not None}
    stepped = [[full[id(p)] for g in o.param_groups for p in g["params"] if id(p) in full]
               for o in opts]
    trainable = sum(u.params[i].numel() for u in model.units for i in u.trainable)
    return {"outcome": outcome, "memory": held, "comm": comm, "units": units,
            "trainable": trainable, "shapes": [tuple(local(p).shape) for u in model.units
                                               for p in u.params],
            "dims": model.mesh.dims, "steps": trial.steps, "stepped": stepped,
            "optimizers": [type(o).__name__ for o in opts]}
