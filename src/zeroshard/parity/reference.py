"""The reference: a trial's K steps on the plain, unsharded model in this process.

What a precision recipe means is written here in plain torch, independently of the
engine's flat buffers, shards and hooks: the optimizer steps the master weights
(``master_dtype``; the weights themselves where there is none); each step the compute
copy (``param_dtype``) is cast from them, each rank's slice of the global batch runs
forward and backward on it, float inputs cast to the compute dtype (FSDP2's
``cast_forward_inputs``), and the slices' gradients are summed in ``reduce_dtype`` in
rank order, divided by N, stored in ``grad_dtype`` and stepped in the master's dtype.
That is what each of the N ranks and their reduction compute, one slice after another.

``nudge``: every summed gradient element moved by at most one unit in the last place of
the reduce dtype, at random — as much as a reduction summing the same slices in another
order may legitimately move it ([Note: the bound] in ``verdict.py``).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from ..runtime.dist import TORCH_DTYPES
from .outcome import Outcome, optimizer_state, optimizers_of
from .trial import Trial, on_device, rows_of

#: Intra-op threads of each rank (``runtime/spawn.py``'s default) and of the reference.
RANK_THREADS = 1


def quiet_dropout(model: nn.Module) -> int:
    """Dropout off (p = 0) in every ``nn.Dropout`` module of ``model``: a rank's draws are
    not the reference's, so a check with dropout on could only say DIFFERS. Returns how
    many modules had p > 0."""
    changed = 0
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            m.p, changed = 0.0, changed + 1
    return changed


def _cast_inputs(dtype: torch.dtype):
    """A root forward pre-hook casting float inputs to ``dtype`` (the engine's own)."""
    cast = lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
    return lambda module, args, kwargs: (tree_map(cast, args), tree_map(cast, kwargs))


class _Recipe:
    """The master weights and their compute copy under the trial's recipe."""

    def __init__(self, master: nn.Module, trial: Trial, exact: bool = False):
        recipe = trial.config.recipe
        self.compute_dtype = TORCH_DTYPES[recipe.param_dtype]
        self.grad_dtype = TORCH_DTYPES[recipe.grad_dtype]
        self.reduce_dtype = TORCH_DTYPES[recipe.reduce_dtype or recipe.grad_dtype]
        if exact:  # every copy in float64: the computation without its rounding
            self.compute_dtype = self.grad_dtype = self.reduce_dtype = torch.float64
        self.master = master
        self.mixed = recipe.master_dtype is not None and not exact
        self.compute = copy.deepcopy(master) if self.mixed else master
        if exact:
            self.compute.register_forward_pre_hook(_cast_inputs(torch.float64),
                                                   with_kwargs=True)
        if self.mixed:
            for p in self.compute.parameters():
                p.data = p.data.to(self.compute_dtype)
            self.compute.register_forward_pre_hook(_cast_inputs(self.compute_dtype),
                                                   with_kwargs=True)
        self.pairs = list(zip(master.named_parameters(), self.compute.parameters(),
                              strict=True))

    def refresh(self) -> None:
        """The compute copy cast from the master (a step changed it)."""
        if self.mixed:
            with torch.no_grad():
                for (_, m), c in self.pairs:
                    c.copy_(m.to(self.compute_dtype))

    def slice_grads(self) -> dict[str, torch.Tensor]:
        """This slice's gradients in the reduce dtype, and cleared for the next slice."""
        out = {}
        for (name, _), c in self.pairs:
            if c.grad is not None:
                out[name] = c.grad.to(self.reduce_dtype)
                c.grad = None
        return out


def _reduce(parts: list[dict], n: int, nudge: torch.Generator | None) -> dict:
    """The slices' gradients summed in rank order and divided by N, as the engine's
    reduction does (``collectives.py``: summed, then divided); with ``nudge``, each
    element then moved by -1, 0 or +1 unit in the last place of its dtype."""
    out = {}
    for name in parts[0]:
        total = parts[0][name].clone()
        for part in parts[1:]:
            total += part[name]
        total /= n
        if nudge is not None:
            step = torch.randint(-1, 2, total.shape, generator=nudge).to(total.dtype)
            total = torch.nextafter(total, total + step * torch.finfo(total.dtype).max)
        out[name] = total
    return out


@torch.no_grad()
def _clip(grads: list[torch.Tensor], max_norm: float, nudge: torch.Generator | None) -> None:
    """Scale the gradients by ``min(1, max_norm / (norm + 1e-6))``, torch's factor, the
    global norm summed in float64 and rounded to fp32 as the engine does
    (``stepping.global_norm``); with ``nudge``, that norm moved by one ulp either way."""
    norm = torch.stack([torch.linalg.vector_norm(g, 2.0, dtype=torch.float64)
                        for g in grads]).pow(2.0).sum().pow(0.5).to(torch.float32)
    if nudge is not None:
        sign = float(torch.randint(0, 2, (), generator=nudge)) * 2 - 1
        norm = torch.nextafter(norm, torch.tensor(sign * float("inf")))
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(grads[0].device))


def run_reference(trial: Trial, nudge: int | None = None, exact: bool = False) -> Outcome:
    """The trial's K steps unsharded; ``nudge``: the seed of the one-ulp nudges;
    ``exact``: in float64 throughout (the floor beside tensor parallelism, [Note: the
    bound] in ``verdict.py``). On the host with the ranks' intra-op threads: a CPU
    kernel that splits a sum over threads (LayerNorm's weight gradient) sums in another
    order with another count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(RANK_THREADS)
    try:
        return _run(trial, nudge, exact)
    finally:
        torch.set_num_threads(threads)


def _run(trial: Trial, nudge: int | None, exact: bool) -> Outcome:
    torch.manual_seed(trial.seed)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    master = trial.build_model().to(device)  # the ranks' kind of device: the same kernels
    if exact:
        master = master.double()
    dropout_off = quiet_dropout(master)
    master.train()
    recipe = _Recipe(master, trial, exact)
    optimizer = trial.build_optimizer(master)
    schedules = trial.schedules(optimizers_of(optimizer))
    names = {id(p): n for n, p in master.named_parameters()}
    outcome = Outcome(initial={n: p.detach().cpu().clone() for n, p in master.named_parameters()})
    gen = torch.Generator().manual_seed(nudge) if nudge is not None else None
    for k, batch in enumerate(trial.batches):
        recipe.refresh()
        parts = []
        for r in range(trial.dp_world):
            loss = trial.loss(recipe.compute, on_device(rows_of(batch, r, trial.dp_world),
                                                        device))
            loss.backward()
            outcome.losses[f"step {k + 1}, rank {r}"] = loss.detach().float().cpu().reshape(())
            parts.append(recipe.slice_grads())
        reduced = _reduce(parts, trial.dp_world, gen)
        for (name, m), _ in recipe.pairs:
            if name in reduced:
                m.grad = reduced[name].to(recipe.grad_dtype).to(m.dtype)
        if k == 0:
            outcome.grads = {n: m.grad.detach().cpu().clone() for (n, m), _ in recipe.pairs
                             if m.grad is not None}
        if trial.clip is not None:
            _clip([m.grad for (_, m), _ in recipe.pairs if m.grad is not None], trial.clip,
                  gen)
        for opt in optimizers_of(optimizer):
            opt.step()
            opt.zero_grad()
        for s in schedules:
            s.step()
    outcome.weights = {n: p.detach().cpu().clone() for n, p in master.named_parameters()}
    outcome.state = optimizer_state(optimizers_of(optimizer), names)
    outcome.optimizers = [type(o).__name__ for o in optimizers_of(optimizer)]
    outcome.dropout_off = dropout_off
    return outcome
