"""AdamW for the host step of optimizer offload: torch's fused CPU kernel, plus the cast.

When the optimizer is offloaded, the fp32 master weights and Adam's two moments live in
host memory and the step runs on the CPU. That step is a pure stream over memory: per
parameter it reads the weight, the gradient and both moments (4 x 4 bytes) and writes the
weight and both moments back (3 x 4 bytes), 28 bytes, with a dozen flops in between. What
decides its speed is therefore how close it gets to the memory bandwidth, and that is a
question of the kernel, not of Python: torch ships a vectorised, OpenMP-parallel fused
AdamW for CPU (``torch._fused_adamw_``, ``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``),
which ``bench/host_adam.py`` measures at the speed of DeepSpeed's hand-written
``DeepSpeedCPUAdam`` and near this machine's bandwidth limit. ``HostAdamW`` calls that
kernel, so its update is bit for bit the one of ``torch.optim.AdamW(fused=True)``; the
state dict has torch's layout (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter) and
loads into torch's AdamW and back.

What it adds is the cast. Offload sends the updated weights back to the device in the
compute dtype, so each master weight may be given an output tensor (bf16 or fp16) that
every step refreshes with ``param.to(out.dtype)``, right after the update. torch has no
kernel that updates and casts in one pass, so the cast is a second, multi-tensor pass
(``torch._foreach_copy_``): 4 bytes read and 2 written per weight. Walking the update in
cache-sized chunks, each cast right behind its chunk, was measured and gained at most 3 %:
torch 2.13's fp32-to-bf16 conversion runs at 7-10 G elements/s per thread whether its
input is in cache or not, so the cast costs its conversion, not its memory traffic.
(One pass compiled by ``torch.compile`` stepped and cast 50 M weights 1.19x faster on one
thread, but it rounds differently from torch's AdamW (a few thousand weights of a million
differ after one step), compiles for ~20 s and needs a C++ compiler at run time; agreeing
with torch's optimizer to the bit is worth more here: offload must be exact.)

The update, per element with g the gradient, t the step count (torch's AdamW)::

    p     <- p * (1 - lr * weight_decay)                 # decoupled weight decay
    m     <- beta1 * m + (1 - beta1) * g
    v     <- beta2 * v + (1 - beta2) * g^2
    p     <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

#: dtypes a cast output may have: the compute dtypes of mixed precision
CAST_DTYPES = (torch.bfloat16, torch.float16)
#: group keys of torch's AdamW that describe what HostAdamW does, so that its state dict,
#: loaded into ``torch.optim.AdamW``, takes the same fused path and continues bit for bit
_TORCH_KEYS = dict(fused=True, foreach=None, capturable=False, differentiable=False,
                   decoupled_weight_decay=True)


def _check_number(name: str, value: Any, low: float, high: float | None = None) -> None:
    """ValueError unless ``low <= value`` (and ``value < high`` when high is given)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"HostAdamW: {name} must be a float, got {value!r}")
    if not (value >= low and (high is None or value < high)):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"HostAdamW: {name} must be {bound}, got {value!r}")


def _check_group(group: dict[str, Any]) -> None:
    """Refuse, by name, any hyper-parameter HostAdamW cannot apply exactly."""
    lr = group["lr"]
    if isinstance(lr, Tensor):
        if lr.numel() != 1 or lr.device.type != "cpu" or not lr.is_floating_point():
            raise ValueError("HostAdamW: a tensor lr must be one floating-point element on the "
                             f"CPU, got shape {tuple(lr.shape)} {lr.dtype} on {lr.device}")
    else:
        _check_number("lr", lr, 0.0)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"HostAdamW: betas must be a pair of floats, got {betas!r}")
    _check_number("betas[0]", betas[0], 0.0, 1.0)
    _check_number("betas[1]", betas[1], 0.0, 1.0)
    _check_number("eps", group["eps"], 0.0)
    _check_number("weight_decay", group["weight_decay"], 0.0)
    for flag in ("amsgrad", "maximize", "differentiable", "capturable"):
        if group.get(flag, False):
            raise NotImplementedError(f"HostAdamW: {flag}={group[flag]!r} is not supported; "
                                      f"accepted: {flag}=False")
    if not group.get("decoupled_weight_decay", True):  # a state dict saved by torch's Adam
        raise ValueError("HostAdamW: decoupled_weight_decay=False (Adam's coupled L2) is not "
                         "AdamW; accepted: decoupled_weight_decay=True")
    for p in group["params"]:
        if p.device.type != "cpu":
            raise ValueError(f"HostAdamW steps host tensors; got a parameter on {p.device} "
                             "(accepted: cpu)")
        if p.dtype != torch.float32:
            raise NotImplementedError(f"HostAdamW steps fp32 master weights; got a {p.dtype} "
                                      "parameter (accepted: torch.float32)")


class HostAdamW(torch.optim.Optimizer):
    """AdamW on host (CPU) fp32 parameters through torch's fused kernel, with the option to
    write each updated weight, cast to the compute dtype, into an output tensor.

    Args:
        params: parameters or param groups, as for any torch optimizer (fp32, on the CPU).
        lr: learning rate, a float or a one-element CPU tensor (changed in place between
            steps, as schedulers may do).
        betas: decay rates of the first and second moment averages.
        eps: added to the denominator, after the bias-corrected square root.
        weight_decay: decoupled weight decay coefficient (AdamW's, multiplied by lr).
        amsgrad, maximize: accepted only as False; True raises NotImplementedError.

    Cast outputs are registered per parameter with :meth:`set_cast_output`; they are not
    part of the state dict (they are buffers of whoever sends weights to the device).
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]],
                 lr: float | Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, amsgrad: bool = False,
                 maximize: bool = False) -> None:
        #: parameter -> the compute-dtype tensor each step refreshes with its cast
        self._cast_out: dict[Tensor, Tensor] = {}
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, **_TORCH_KEYS)
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled or deep-copied: torch's state, and no cast outputs (they are buffers of
        the engine that registered them, not state)."""
        super().__setstate__(state)
        self.__dict__.setdefault("_cast_out", {})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group as torch does, then refuse what the fused AdamW cannot do exactly."""
        super().add_param_group(param_group)
        try:
            _check_group(self.param_groups[-1])
        except (ValueError, NotImplementedError):
            self.param_groups.pop()
            raise

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of HostAdamW or of torch's AdamW (same layout); its groups are
        checked like new ones before anything is loaded."""
        for group in state_dict["param_groups"]:
            _check_group({**group, "params": []})
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.update(_TORCH_KEYS)  # what this optimizer does, whoever saved the file

    def set_cast_output(self, param: Tensor, out: Tensor) -> None:
        """From now on, every step writes ``param.to(out.dtype)`` into ``out``.

        ``out`` has the parameter's shape, a compute dtype (bf16 or fp16) and lives on the
        CPU (pinned memory, for a fast copy to the device, is the caller's choice). It is
        written at once, so it always holds the cast of the current weights.
        """
        if not any(param is p for g in self.param_groups for p in g["params"]):
            raise ValueError("HostAdamW.set_cast_output: the parameter is not in this "
                             "optimizer's param groups")
        if out.dtype not in CAST_DTYPES:
            raise ValueError(f"HostAdamW.set_cast_output: out has dtype {out.dtype}; "
                             f"accepted: {', '.join(str(d) for d in CAST_DTYPES)}")
        if out.shape != param.shape or out.device.type != "cpu":
            raise ValueError(f"HostAdamW.set_cast_output: out is {tuple(out.shape)} on "
                             f"{out.device}; accepted: the parameter's shape "
                             f"{tuple(param.shape)} on cpu")
        if not out.is_contiguous():
            raise ValueError("HostAdamW.set_cast_output: out must be contiguous")
        self._cast_out[param] = out
        with torch.no_grad():
            out.copy_(param)

    def remove_cast_output(self, param: Tensor) -> None:
        """Stop writing the parameter's cast (no error if none was set)."""
        self._cast_out.pop(param, None)

    @torch.no_grad()
    def write_cast_outputs(self) -> None:
        """Rewrite every cast output from its parameter (after weights changed outside a
        step, e.g. a checkpoint loaded into the master)."""
        for p, out in self._cast_out.items():
            out.copy_(p)

    def _state(self, p: Tensor) -> dict[str, Tensor]:
        """The parameter's state, created on first use exactly as torch's fused AdamW
        creates it (a float32 step counter on the CPU and two zero moments)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One AdamW update of every parameter that has a gradient, then the casts."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lists: list[list[Tensor]] = [[], [], [], [], []]  # params, grads, m, v, steps
            casts: list[list[Tensor]] = [[], []]  # outputs, their params
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise NotImplementedError("HostAdamW: sparse gradients are not supported")
                if p.grad.dtype != p.dtype or p.grad.device != p.device:
                    raise ValueError(f"HostAdamW: a gradient is {p.grad.dtype} on "
                                     f"{p.grad.device}; accepted: the parameter's "
                                     f"{p.dtype} on {p.device} (upcast it into p.grad)")
                state = self._state(p)
                for lst, t in zip(lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                                          state["step"])):
                    lst.append(t)
                out = self._cast_out.get(p)
                if out is not None:
                    casts[0].append(out)
                    casts[1].append(p)
            if not lists[0]:
                continue
            # t <- t + 1 first, as torch's fused AdamW does; the kernel reads t from them.
            torch._foreach_add_(lists[4], 1)
            beta1, beta2 = group["betas"]
            torch._fused_adamw_(*lists[:4], [], lists[4], lr=group["lr"], beta1=beta1,
                                beta2=beta2, weight_decay=group["weight_decay"],
                                eps=group["eps"], amsgrad=False, maximize=False)
            if casts[0]:
                torch._foreach_copy_(casts[0], casts[1])  # out <- param.to(out.dtype)
        return loss
