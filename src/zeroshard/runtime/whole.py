"""Optimizers whose step is not elementwise, stepped by the engine on each rank's rows:
an optimizer's shards with their full shapes, Adafactor's and LAMB's whole-tensor sums
all-reduced, Muon's whole matrices orthogonalised by an owner.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..optim.lamb import lamb_apply, lamb_directions
from ..spec.formulas import dim0_rows
from ..spec.optimizers import assign_owners

# ----------------------------------------------------------------------------------------
# What the engine's own optimizer steps (``reduced.py``, ``matrix.py``) read off the
# model: each shard an optimizer holds with the full parameter's shape and the first full
# row this rank holds, and the one all-reduce that completes sums over rows.
# ----------------------------------------------------------------------------------------

class Rows(NamedTuple):
    """One parameter of an optimizer, as this rank holds it."""

    shard: torch.Tensor
    """The optimizer's tensor: this rank's rows, ``[rows, *shape[1:]]``."""
    shape: tuple[int, ...]
    """The full parameter's shape."""
    first: int
    """The first full row the shard holds."""
    group: dict
    """The optimizer's param group it is in (its hyper-parameters, read at each step)."""

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        n = 1
        for d in self.shape:
            n *= d
        return n


def rows_of(optimizer, units) -> list[Rows]:
    """The shards of ``units`` that ``optimizer`` steps, in its param groups' order."""
    table = {id(u.shards[i]): (u, i) for u in units for i in u.trainable}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            hit = table.get(id(p))
            if hit is None:  # frozen, or another model's
                continue
            u, i = hit
            shape = tuple(u.params[i].shape)
            first = dim0_rows(shape[0] if shape else 1, u.rank, u.world)[0]
            out.append(Rows(p, shape, first, group))
    return out


def with_grads(rows: list[Rows]) -> list[Rows]:
    """The parameters that have a gradient this step: the same on every rank (a shard
    gets one where any rank saw its parameter, ``unit.assign_step_grads``), so every rank
    issues the same collectives."""
    return [r for r in rows if r.shard.grad is not None]


def drop_grads(rows: list[Rows]) -> None:
    """The engine has stepped these: the optimizer's own ``step()`` finds no gradient."""
    for r in rows:
        r.shard.grad = None


def sum_over_ranks(comm, parts: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Each of ``parts`` (partial sums over this rank's rows) added up over the shard
    group: one all-reduce of their fp64 concatenation, whatever their number. fp64 so
    that the sums' order across ranks changes nothing an fp32 update can see."""
    if not parts:
        return []
    flat = torch.cat([p.detach().reshape(-1).to(torch.float64) for p in parts]).to(device)
    comm.all_reduce(flat)
    flat = flat.to(parts[0].device)
    out, at = [], 0
    for p in parts:
        out.append(flat[at:at + p.numel()].view(p.shape))
        at += p.numel()
    return out


# ----------------------------------------------------------------------------------------
# The engine's step for optimizers whose update reads sums over whole tensors
# (``Need.REDUCTIONS`` in ``spec/optimizers.py``): torch's Adafactor and zeroshard's LAMB.
#
# Each such sum (a norm, a column statistic, a mean over rows) is a sum over rows. Every
# rank adds up its own rows in fp64 and one all-reduce over the shard group, of every
# parameter's partial sums concatenated, gives every rank the whole tensors' sums
# (``rows.sum_over_ranks``); everything else is the optimizer's own elementwise maths on
# the rows. The state stays in the optimizer, under torch's keys, for the rows this rank
# holds (Adafactor's column statistic of a matrix spans every row, so each rank keeps it
# whole, the same on every rank).
#
# **Adafactor** (Shazeer and Stern, 2018; torch's ``_single_tensor_adafactor``, step by
# step). For a parameter x of n elements with gradient G, at step t, ρ = min(lr, 1/√t),
# β̂ = t^beta2_decay:
#
# 1. rows alone: R <- lerp(R, mean_j G², β̂) per row (``row_var``); partial sums of
#    ``x²``, of ``G²`` down each column, and of R;
# 2. round one, all-reduced: α = max(eps2, ||x||/√n)·ρ; weight decay; the column means
#    C <- lerp(C, Σ_i G²/rows, β̂) (``col_var``, whole); V = R·C / mean(R) on the rows,
#    U = G / √max(V, eps1²), and U's partial sum of squares;
# 3. round two, all-reduced: x <- x - α / max(1, ||U||/(√n·d)) · U.
#
# The second round reads the column statistics the first completes, so Adafactor takes
# two all-reduces a step. A tensor of three or more dimensions factors its last two, and
# dim 0 (the sharded one) is neither: its statistics are all on the rows. A vector keeps
# a per-element ``variance``, and needs only the two norms.
#
# **LAMB** (``zeroshard/optim/lamb.py``): the moments and the update direction u on the
# rows, then one all-reduce of the partial sums of x² and u², and x <- x - lr·||x||/||u||·u.
#
# The sums are fp64 and in another order than torch's, so the update matches the
# unsharded one to rounding (measured within 1e-6 after 20 steps), not bit for bit.
# ----------------------------------------------------------------------------------------

def _scalar(value) -> float:
    return value.item() if torch.is_tensor(value) else float(value)


class ReducedStep:
    """One optimizer's step on this rank's rows, its whole-tensor sums all-reduced."""

    def __init__(self, optimizer, stepper):
        self.optimizer, self.stepper = optimizer, stepper
        self.lamb = type(optimizer).__name__ == "Lamb"

    def _sum(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        return sum_over_ranks(self.stepper.comm, parts, self.stepper.units[0].device)

    @torch.no_grad()
    def step(self) -> None:
        every = rows_of(self.optimizer, self.stepper.units)
        rows = with_grads(every)
        if rows:
            (self._lamb if self.lamb else self._adafactor)(rows)
        drop_grads(every)

    # -- LAMB -----------------------------------------------------------------------
    def _lamb(self, rows) -> None:
        opt, groups = self.optimizer, []
        for group in opt.param_groups:
            params = [r.shard for r in rows if r.group is group]
            if not params:
                continue
            beta1, beta2 = group["betas"]
            updates = lamb_directions(*opt.group_tensors({"params": params}), beta1=beta1,
                                      beta2=beta2, eps=group["eps"],
                                      weight_decay=group["weight_decay"])
            groups.append((group, params, updates))
        parts = [t.double().square().sum() for _, ps, us in groups for t in (*ps, *us)]
        sums = torch.stack(self._sum(parts)).tolist()
        at = 0
        for group, params, updates in groups:
            n = len(params)
            lamb_apply(params, updates, sums[at:at + 2 * n], _scalar(group["lr"]))
            at += 2 * n

    # -- Adafactor ------------------------------------------------------------------
    def _adafactor(self, rows) -> None:
        if getattr(self.optimizer, "grad_scale", None) is not None:
            raise NotImplementedError("Adafactor with grad_scale set (torch.amp's fused "
                                      "scaling) on shards; accepted: grad_scale=None "
                                      "(use zs.GradScaler for fp16)")
        steps, parts = [], []
        for r in rows:  # 1. the rows alone, and this rank's partial sums
            s = self._begin(r)
            steps.append(s)
            parts.append(r.shard.double().square().sum())
            if s["whole_columns"]:
                parts.append(s["grad"].double().square().sum(dim=-2, keepdim=True))
                parts.append(s["state"]["row_var"].double().sum())
        sums = iter(self._sum(parts))
        parts = []
        for r, s in zip(rows, steps):  # 2. round one's sums in; the update on the rows
            x_sq = next(sums)
            cols = (next(sums), next(sums)) if s["whole_columns"] else None
            parts.append(self._update(r, s, x_sq, cols))
        for r, s, u_sq in zip(rows, steps, self._sum(parts)):  # 3. round two's
            d = r.group["d"]
            denom = max(1.0, math.sqrt(u_sq.item()) / (math.sqrt(r.numel) * d))
            r.shard.add_(s["update"], alpha=-s["alpha"] / denom)

    def _begin(self, r) -> dict:
        """Step t, the state made as torch makes it on first use, ``row_var`` updated."""
        group, p = r.group, r.shard
        grad = -p.grad if group["maximize"] else p.grad
        state = self.optimizer.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if grad.dim() > 1:
                state["row_var"] = grad.new_zeros([*grad.shape[:-1], 1])
                state["col_var"] = grad.new_zeros([*grad.shape[:-2], 1, grad.shape[-1]])
            else:
                state["variance"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        state["step"] += 1
        t = state["step"].item()
        lr = _scalar(group["lr"])
        s = {"grad": grad, "state": state, "t": t, "lr": lr,
             "beta": t ** group["beta2_decay"], "rho": min(lr, 1 / (t ** 0.5)),
             "eps1": group["eps"][0] if group["eps"][0] is not None
             else torch.finfo(p.dtype).eps,
             "whole_columns": grad.dim() == 2}  # dim -2 is dim 0: spread over the ranks
        if grad.dim() > 1:  # the mean of G² along each row: this rank's rows alone
            row_mean = torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
            state["row_var"].lerp_(row_mean, s["beta"])
        return s

    def _update(self, r, s, x_sq, cols) -> torch.Tensor:
        """α, weight decay, the column statistics, U; returns U's partial sum of squares."""
        group, p, grad, state = r.group, r.shard, s["grad"], s["state"]
        eps1 = s["eps1"]
        s["alpha"] = max(group["eps"][1], math.sqrt(x_sq.item()) / (r.numel ** 0.5)) * s["rho"]
        if group["weight_decay"] != 0:
            p.mul_(1 - s["lr"] * group["weight_decay"])
        if grad.dim() > 1:
            row_var, col_var = state["row_var"], state["col_var"]
            if cols is not None:  # torch's norm(dim=-2)².div(rows) and mean(row_var)
                col_sq, row_sum = cols
                col_mean = col_sq.sqrt().to(p.dtype).square_().div_(r.shape[0])
                row_mean = (row_sum / r.shape[0]).to(p.dtype).reshape(1, 1)
            else:
                col_mean = torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
                row_mean = row_var.mean(dim=-2, keepdim=True)
            col_var.lerp_(col_mean, s["beta"])
            estimate = row_var @ col_var
            estimate.div_(row_mean.clamp_(min=eps1))
        else:
            state["variance"].lerp_(grad * grad, s["beta"])
            estimate = state["variance"].clone()
        update = estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(grad)
        s["update"] = update
        return update.double().square().sum()


# ----------------------------------------------------------------------------------------
# The engine's step for an optimizer whose update needs each whole matrix
# (``Need.WHOLE_MATRIX`` in ``spec/optimizers.py``): torch's Muon, by owner computes.
#
# Muon (Jordan et al., 2024; torch's ``_single_tensor_muon``), per matrix W with gradient
# G, momentum μ, step by step::
#
#     B <- lerp(B, G, 1 - μ)                         # momentum buffer: elementwise
#     M <- lerp(G, B, μ) if nesterov else B          # elementwise
#     O <- NewtonSchulz(M)                           # the whole matrix
#     W <- W·(1 - lr·wd) - lr·adjust(shape)·O         # elementwise, O's rows
#
# Only O needs the whole matrix. So every rank updates the momentum of its own rows (the
# state stays row-sharded, under torch's key ``momentum_buffer``: checkpoints reshard it
# like Adam's), and the orthogonalisation is computed once per matrix by its **owner**:
#
# 1. owners: ``spec.optimizers.assign_owners`` spreads the matrices over the shard group,
#    the costliest Newton-Schulz first to the least loaded rank (the same answer on every
#    rank, and in the planner);
# 2. ``owner_gather``: one all-to-all sends each owner every rank's rows of M for the
#    matrices it owns (this rank's own rows stay put);
# 3. the owner runs torch's ``_zeropower_via_newtonschulz`` on the whole matrix: the very
#    function, on the very matrix, of the unsharded step, so O is the same bits;
# 4. ``owner_scatter``: a second all-to-all sends each rank its rows of O (bf16, the
#    dtype torch's iteration returns), and every rank applies weight decay and O to its
#    rows with torch's learning-rate adjustment for the *full* shape.
#
# Two all-to-alls a step, whatever the number of matrices; the bytes each rank sends are
# its rows of the matrices others own, and, for those it owns, the other ranks' rows of O
# (``spec.optimizers.owner_bytes``, which the planner uses and the ledger measures). The
# owner holds the whole input and result of the matrices it owns for the step (transient).
# Where the optimizer state is offloaded, the iteration runs on the host, where the rows
# are; the all-to-alls run on the device the collectives use.
# ----------------------------------------------------------------------------------------

try:  # torch >= 2.9; private, but it is the maths torch's Muon runs
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
except ImportError:  # pragma: no cover - older torch has no Muon class to drive
    _adjust_lr = _zeropower_via_newtonschulz = None


class MatrixStep:
    """One Muon's step on this rank's rows, each matrix orthogonalised by its owner."""

    def __init__(self, optimizer, stepper):
        if _zeropower_via_newtonschulz is None:  # pragma: no cover
            raise NotImplementedError("torch.optim.Muon on shards needs torch's "
                                      "torch.optim._muon (torch >= 2.9)")
        self.optimizer, self.stepper = optimizer, stepper
        self.comm = stepper.comm
        self.device = stepper.units[0].device  # where the collectives run
        self._owners: dict[tuple, list[int]] = {}

    def owners(self, rows) -> list[int]:
        """The owner of each matrix with a gradient (cached by the matrices present)."""
        key = tuple((r.shape, r.group["ns_steps"]) for r in rows)
        if key not in self._owners:
            world = self.comm.mesh.shard_world
            by_steps: dict[int, list[int]] = {}
            for j, r in enumerate(rows):
                by_steps.setdefault(r.group["ns_steps"], []).append(j)
            owner = [0] * len(rows)
            for steps, js in by_steps.items():  # one balance per iteration count
                for j, o in zip(js, assign_owners([rows[j].shape for j in js], world, steps)):
                    owner[j] = o
            self._owners[key] = owner
        return self._owners[key]

    @torch.no_grad()
    def step(self) -> None:
        every = rows_of(self.optimizer, self.stepper.units)
        rows = with_grads(every)
        if rows:
            momenta = [self._momentum(r) for r in rows]
            ortho = self._orthogonalise(rows, momenta, self.owners(rows))
            for r, o in zip(rows, ortho):
                g = r.group
                lr = _scalar(g["lr"])
                r.shard.mul_(1 - lr * g["weight_decay"])
                r.shard.add_(o, alpha=-_adjust_lr(lr, g["adjust_lr_fn"], torch.Size(r.shape)))
        drop_grads(every)

    def _momentum(self, r) -> torch.Tensor:
        """This rank's rows of M, the momentum buffer updated as torch's Muon does."""
        g, p = r.group, r.shard
        state = self.optimizer.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad,
                                                        memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - g["momentum"])
        return p.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf

    def _orthogonalise(self, rows, momenta, owners) -> list[torch.Tensor]:
        """Each matrix's rows of NewtonSchulz(M), computed by its owner."""
        world, me = self.comm.mesh.shard_world, self.comm.mesh.shard_rank
        cols = [r.shape[1] for r in rows]
        # chunk[k][j]: rows [a, b) of matrix j that rank k holds (the shards' dim-0 chunks)
        chunk = [[dim0_rows(r.shape[0], k, world) for r in rows] for k in range(world)]
        held = [[b - a for a, b in ranks] for ranks in chunk]
        by_owner = [[j for j, o in enumerate(owners) if o == k] for k in range(world)]
        mine = by_owner[me]
        total = sum(r.numel for r in rows)  # every rank's pieces, for the fingerprint
        # 2. owner_gather: to each owner, this rank's rows of the matrices it owns
        dtype = momenta[0].dtype
        send = torch.cat([momenta[j].reshape(-1) for k in range(world) for j in by_owner[k]]
                         ).to(self.device, dtype)
        in_splits = [sum(held[me][j] * cols[j] for j in by_owner[k]) for k in range(world)]
        out_splits = [sum(held[k][j] * cols[j] for j in mine) for k in range(world)]
        got = torch.empty(sum(out_splits), dtype=dtype, device=self.device)
        self.comm.all_to_all(got, send, out_splits, in_splits, "owner_gather", total)
        # 3. the owner's whole matrices (pieces arrive in rank order, row chunk by chunk)
        got = got.to(rows[0].shard.device)
        pieces, at = {j: [] for j in mine}, 0
        for k in range(world):
            for j in mine:
                n = held[k][j] * cols[j]
                pieces[j].append(got[at:at + n])
                at += n
        results = {}
        for j in mine:
            g = rows[j].group
            whole = torch.cat(pieces[j]).view(rows[j].shape)
            results[j] = _zeropower_via_newtonschulz(whole, g["ns_coefficients"],
                                                     g["ns_steps"], g["eps"])
            assert results[j].dtype == torch.bfloat16  # what every receiver expects
        # 4. owner_scatter: to each rank, its rows of the results this rank owns
        send = torch.cat([results[j][chunk[k][j][0]:chunk[k][j][1]].reshape(-1)
                          for k in range(world) for j in mine]
                         or [torch.empty(0, dtype=torch.bfloat16)]).to(self.device)
        back_in = [sum(held[k][j] * cols[j] for j in mine) for k in range(world)]
        back_out = [sum(held[me][j] * cols[j] for j in by_owner[k]) for k in range(world)]
        back = torch.empty(sum(back_out), dtype=torch.bfloat16, device=self.device)
        self.comm.all_to_all(back, send, back_out, back_in, "owner_scatter", total)
        back = back.to(rows[0].shard.device)
        out, at = [None] * len(rows), 0
        for k in range(world):
            for j in by_owner[k]:
                n = held[me][j] * cols[j]
                out[j] = back[at:at + n].view(held[me][j], cols[j])
                at += n
        return out
