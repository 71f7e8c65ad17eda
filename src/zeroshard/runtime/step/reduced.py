"""The engine's step for optimizers whose update reads sums over whole tensors
(``Need.REDUCTIONS`` in ``spec/optimizers.py``): torch's Adafactor and zeroshard's LAMB.

Each such sum (a norm, a column statistic, a mean over rows) is a sum over rows. Every
rank adds up its own rows in fp64 and one all-reduce over the shard group, of every
parameter's partial sums concatenated, gives every rank the whole tensors' sums
(``rows.sum_over_ranks``); everything else is the optimizer's own elementwise maths on
the rows. The state stays in the optimizer, under torch's keys, for the rows this rank
holds (Adafactor's column statistic of a matrix spans every row, so each rank keeps it
whole, the same on every rank).

**Adafactor** (Shazeer and Stern, 2018; torch's ``_single_tensor_adafactor``, step by
step). For a parameter x of n elements with gradient G, at step t, ρ = min(lr, 1/√t),
β̂ = t^beta2_decay:

1. rows alone: R <- lerp(R, mean_j G², β̂) per row (``row_var``); partial sums of
   ``x²``, of ``G²`` down each column, and of R;
2. round one, all-reduced: α = max(eps2, ||x||/√n)·ρ; weight decay; the column means
   C <- lerp(C, Σ_i G²/rows, β̂) (``col_var``, whole); V = R·C / mean(R) on the rows,
   U = G / √max(V, eps1²), and U's partial sum of squares;
3. round two, all-reduced: x <- x - α / max(1, ||U||/(√n·d)) · U.

The second round reads the column statistics the first completes, so Adafactor takes
two all-reduces a step. A tensor of three or more dimensions factors its last two, and
dim 0 (the sharded one) is neither: its statistics are all on the rows. A vector keeps
a per-element ``variance``, and needs only the two norms.

**LAMB** (``zeroshard/optim/lamb.py``): the moments and the update direction u on the
rows, then one all-reduce of the partial sums of x² and u², and x <- x - lr·||x||/||u||·u.

The sums are fp64 and in another order than torch's, so the update matches the
unsharded one to rounding (measured within 1e-6 after 20 steps), not bit for bit.
"""

from __future__ import annotations

import math

import torch

from ...optim.lamb import lamb_apply, lamb_directions
from .rows import drop_grads, rows_of, sum_over_ranks, with_grads


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
