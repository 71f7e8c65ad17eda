"""The step side of the sharded model: gradients made final, clipped, checked for
non-finite values, handed to the optimizer, and the compute weights brought up to date
after it ([Note: the step cycle] in ``sharded.py``)."""

from __future__ import annotations

import torch

from ...offload.stream import DiskStep, after_streamed_step, check_streamable
from . import nonfinite
from .clip import check_clip_args, clip_grad_norm
from .cycle import CycleState
from .optim import check_optimizer


class Stepping:
    """Mixin of :class:`ShardedModel`: ``before_step``/``after_step`` (the optimizer's
    global hooks), ``zero_grad``, ``clip_grad_norm_`` and the non-finite policy."""

    def _init_stepping(self) -> None:
        self._stepped_by: int | None = None  # id of the optimizer that stepped this cycle
        self._checked: set[int] = set()
        self._cycle_norm: torch.Tensor | None = None  # the clipped norm of this cycle
        self._verdict: tuple[str, str] | None = None  # a loss scaler's: ("skip", why)
        self.loss_scaler = None
        """The :class:`~zeroshard.runtime.step.scaler.GradScaler` made for this model, if any."""
        self.steps = 0
        """Optimizer steps taken (skipped ones included): every rank counts alike."""
        self.skipped_steps = 0
        """Steps skipped for non-finite gradients (``nonfinite="skip"``)."""
        self.last_step_skipped = False
        """Whether the latest optimizer step was skipped for non-finite gradients."""
        self._disk_step = None  # disk offload: the streamed step (offload/stream.py)
        if self.policy.optimizer_on_disk:
            self._disk_step = DiskStep(self.units, self.policy.sub_group_size)

    def _finalize_grads(self) -> None:
        """Finish every reduction and give each shard its gradient (idempotent)."""
        state = self.cycle.state
        self.cycle.advance("finalize")  # refused inside backward and inside the step
        if state in (CycleState.REDUCING, CycleState.UNREDUCED):
            self.reducer.finalize(unreduced=state is CycleState.UNREDUCED)

    def before_step(self, optimizer) -> None:
        """The optimizer step's pre-hook (``optim.py``): gradients made final, checked
        per ``ZeroConfig.nonfinite``, and withheld from the optimizer on a skip."""
        if id(optimizer) not in self._checked:
            check_optimizer(optimizer, self.policy)
            if self._disk_step is not None:
                check_streamable(optimizer)
            self._checked.add(id(optimizer))
        if self._stepped_by not in (None, id(optimizer)):
            raise NotImplementedError(
                f"{type(optimizer).__name__}.step() after another optimizer's step with no "
                "backward in between: a sharded model hands each cycle's gradients to one "
                "optimizer step, and frees them after it. Put every parameter in one "
                "optimizer (param groups may differ in lr and weight decay)")
        if self.cycle.state in (CycleState.BACKWARD, CycleState.STEP):
            self.cycle.advance("step_begin")  # refused, with what was expected
        self.comm.phase = "step"
        self.events.emit("step_begin", optimizer=optimizer)  # the landing counts in the step
        self._finalize_grads()
        self.last_step_skipped = False
        problem, skip = None, False
        if self._verdict is not None:  # a loss scaler has checked (and agreed) already
            skip = self._verdict[0] == "skip"
        elif self.units[0].compute_dtype == torch.float16:
            raise ValueError(
                "mixed_precision='fp16': fp16 gradients overflow and underflow without "
                "dynamic loss scaling, and this step has none. Use scaler = "
                "zs.GradScaler(model); scaler.scale(loss).backward(); scaler.step(optimizer); "
                "scaler.update() — or mixed_precision='bf16'")
        elif self.zero_config.nonfinite != "ignore":
            problem = nonfinite.verdict(self.units, self.comm, self._cycle_norm,
                                        self.steps + 1)
            if problem is not None and self.zero_config.nonfinite == "raise":
                raise nonfinite.NonFiniteGradients(problem)
            skip = problem is not None
        if skip:  # an optimizer steps no parameter without .grad, on every rank alike
            for _, shard in self._named_shards:
                shard.grad = None
            self.last_step_skipped = True
            self.skipped_steps += 1
        if self._disk_step is not None:  # the step itself, streamed from the files; the
            self._disk_step.step(optimizer)  # optimizer's own step then finds no gradient
        self.cycle.advance("step_begin")
        self._stepped_by = id(optimizer)

    def after_step(self) -> None:
        """The optimizer step's post-hook: compute weights brought up to date."""
        self.cycle.advance("step_end")
        # All-gathers after the step go unit by unit; at most two are in flight, so the
        # gathered buffers never add up to a second copy of the model.
        prev = None
        for u in self.units:
            if u.disk is not None:
                after_streamed_step(u)
            else:
                u.after_step()
            if prev is not None:
                prev.wait_sync()
            prev = u
        self._cycle_norm = self._verdict = None
        self.steps += 1
        self.comm.step, self.comm.phase = self.steps, "between steps"
        self.events.emit("step_end")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the shards' gradients and start a new accumulation cycle."""
        self.cycle.advance("zero_grad")
        self._cycle_norm = self._verdict = None
        super().zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip by the global norm over all ranks' shards (padding never counts); return
        the norm (see :func:`zeroshard.runtime.step.clip.clip_grad_norm`). A non-finite norm
        raises with ``error_if_nonfinite`` (as torch's), and otherwise leaves the
        decision to ``ZeroConfig.nonfinite`` at the step, with no further exchange."""
        check_clip_args(max_norm, norm_type)
        self._finalize_grads()
        norm = clip_grad_norm(self.units, self.comm, max_norm, norm_type, error_if_nonfinite)
        self._cycle_norm = norm
        return norm
