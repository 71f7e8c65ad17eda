"""LAMB: Adam's direction scaled per tensor by a trust ratio (You et al., 2019, "Large
Batch Optimization for Deep Learning: Training BERT in 76 minutes", algorithm 2).

Per parameter x with gradient g, at step t::

    m <- beta1·m + (1 - beta1)·g            v <- beta2·v + (1 - beta2)·g²
    r <- (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
    u <- r + weight_decay·x
    x <- x - lr · (||x|| / ||u||) · u       (the ratio 1 when either norm is 0)

Everything but the two norms is elementwise. The norms are of the *whole* tensor: a rank
holding some rows of x that took ||rows|| for ||x|| would scale its rows by another
ratio than the unsharded update (``examples/lamb.py`` measures how far). Each norm is a
sum of squares over rows, so :func:`lamb` takes the function that turns the tensors into
their whole sums of squares: alone, a local sum; on a sharded model the engine passes
one that adds every rank's partial sums in one all-reduce (``runtime/whole.py``),
and the update is the unsharded one to the last bits of an fp64 sum.

The state has Adam's keys (``step``, ``exp_avg``, ``exp_avg_sq``), shaped like the
parameter, so a sharded model's checkpoints reshard it like AdamW's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor


def local_sum_squares(tensors: list[Tensor]) -> list[float]:
    """Each tensor's sum of squares, accumulated in fp64."""
    if not tensors:
        return []
    return torch.stack([t.detach().double().square().sum() for t in tensors]).tolist()


@torch.no_grad()
def lamb_directions(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                    exp_avg_sqs: list[Tensor], steps: list[Tensor], *, beta1: float,
                    beta2: float, eps: float, weight_decay: float) -> list[Tensor]:
    """The elementwise part of a LAMB step: the moments and steps advanced, and each
    parameter's update u before its trust ratio (new tensors)."""
    if not params:
        return []
    torch._foreach_add_(steps, 1)
    updates = []
    for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step = t.item()
        u = (m / (1 - beta1 ** step)).div_((v / (1 - beta2 ** step)).sqrt_().add_(eps))
        if weight_decay:
            u.add_(p, alpha=weight_decay)
        updates.append(u)
    return updates


@torch.no_grad()
def lamb_apply(params: list[Tensor], updates: list[Tensor], sums: list[float],
               lr: float) -> None:
    """``x <- x - lr·(||x|| / ||u||)·u``, ``sums`` the whole tensors' sums of squares:
    each parameter's, then each update's."""
    n = len(params)
    for p, u, w2, u2 in zip(params, updates, sums[:n], sums[n:]):
        trust = (w2 ** 0.5) / (u2 ** 0.5) if w2 > 0 and u2 > 0 else 1.0
        p.add_(u, alpha=-lr * trust)


@torch.no_grad()
def lamb(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
         exp_avg_sqs: list[Tensor], steps: list[Tensor], *, lr: float, beta1: float,
         beta2: float, eps: float, weight_decay: float,
         sum_squares: Callable[[list[Tensor]], list[float]] = local_sum_squares) -> None:
    """One LAMB step of ``params`` (functional, as torch's ``adamw``); ``sum_squares``
    gives each tensor's sum of squares over the whole parameter it is (part of)."""
    updates = lamb_directions(params, grads, exp_avgs, exp_avg_sqs, steps, beta1=beta1,
                              beta2=beta2, eps=eps, weight_decay=weight_decay)
    if updates:
        lamb_apply(params, updates, sum_squares(list(params) + updates), lr)


class Lamb(torch.optim.Optimizer):
    """LAMB (see the module's note); a sharded model steps it exactly at every stage.

    Args:
        params: parameters or param groups, as for any torch optimizer.
        lr: learning rate.
        betas: decay rates of the first and second moment averages.
        eps: added to the denominator, after the bias-corrected square root.
        weight_decay: added to the update before the trust ratio (LAMB's λ).
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0) -> None:
        for name, value, ok, accepted in (
                ("lr", lr, lr >= 0, ">= 0"), ("eps", eps, eps >= 0, ">= 0"),
                ("weight_decay", weight_decay, weight_decay >= 0, ">= 0"),
                ("betas[0]", betas[0], 0 <= betas[0] < 1, "in [0, 1)"),
                ("betas[1]", betas[1], 0 <= betas[1] < 1, "in [0, 1)")):
            if not ok:
                raise ValueError(f"Lamb: {name}={value!r}; accepted: {accepted}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))

    def group_tensors(self, group: dict[str, Any]) -> tuple[list[Tensor], ...]:
        """(params, grads, exp_avgs, exp_avg_sqs, steps) of the group's parameters that
        have a gradient, their state made on first use."""
        out: tuple[list[Tensor], ...] = ([], [], [], [], [])
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise NotImplementedError("Lamb: sparse gradients are not supported")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for lst, t in zip(out, (p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                                    state["step"])):
                lst.append(t)
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lamb(*self.group_tensors(group), lr=group["lr"], beta1=beta1, beta2=beta2,
                 eps=group["eps"], weight_decay=group["weight_decay"])
        return loss
