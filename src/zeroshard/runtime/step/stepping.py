"""The step side of a sharded model: gradients made final, clipped, checked for
non-finite values, handed to the optimizer, and the compute weights brought up to date
after it ([Note: the step cycle] in ``model/sharded.py``).

:class:`Stepper` is one collaborator of the model, owning the step's state (which
optimizer stepped this cycle, the clipped norm, a loss scaler's verdict, the step
counters); the optimizer's global hooks (``optim.py``), ``zero_grad``,
``clip_grad_norm_`` and the loss scaler call its methods.
"""

from __future__ import annotations

import torch

from ...offload.stream import DiskStep, check_streamable
from . import nonfinite
from .clip import check_clip_args, clip_grad_norm
from .cycle import CycleState, StepCycle
from .optim import check_optimizer
from .optim_state import attach


class Stepper:
    """Before and after the optimizer step of one sharded model."""

    def __init__(self, units, comm, reducer, cycle: StepCycle, policy, config, events,
                 named_shards):
        self.units, self.comm, self.reducer, self.cycle = units, comm, reducer, cycle
        self.policy, self.config, self.events = policy, config, events
        self.named_shards = named_shards  # (name, shard) in the module's order
        self.stepped_by: int | None = None  # id of the optimizer that stepped this cycle
        self.checked: set[int] = set()  # ids of optimizers already checked
        self.cycle_norm: torch.Tensor | None = None  # the clipped norm of this cycle
        self.verdict: tuple[str, str] | None = None  # a loss scaler's: ("skip", why)
        self.loss_scaler = None  # the GradScaler made for the model, if any
        self.steps = 0  # optimizer steps taken (skipped ones included), alike on every rank
        self.skipped_steps = 0  # steps skipped for non-finite gradients
        self.last_step_skipped = False
        self.disk_step = None  # disk offload: the streamed step (offload/stream.py)
        if policy.optimizer_on_disk:
            self.disk_step = DiskStep(units, policy.sub_group_size)

    # -- the cycle's gradients ------------------------------------------------------
    def backward_begins(self) -> None:
        """A new backward changes the gradients: nothing decided about them still holds."""
        self.stepped_by = None
        self.cycle_norm = self.verdict = None

    def finalize_grads(self) -> None:
        """Finish every reduction and give each shard its gradient (idempotent)."""
        state = self.cycle.state
        self.cycle.advance("finalize")  # refused inside backward and inside the step
        if state in (CycleState.REDUCING, CycleState.UNREDUCED):
            self.reducer.finalize(unreduced=state is CycleState.UNREDUCED)

    def attach_scaler(self, scaler) -> None:
        self.loss_scaler = scaler

    def set_verdict(self, skip: bool, why: str) -> None:
        """A loss scaler has checked the gradients (and every rank agreed): the step
        skips or steps on its word, with no exchange of its own."""
        self.verdict = ("skip" if skip else "step", why)

    def clip(self, max_norm: float, norm_type: float = 2.0,
             error_if_nonfinite: bool = False) -> torch.Tensor:
        """``model.clip_grad_norm_``: the global norm over every rank's shards."""
        check_clip_args(max_norm, norm_type)
        self.finalize_grads()
        norm = clip_grad_norm(self.units, self.comm, max_norm, norm_type, error_if_nonfinite)
        self.cycle_norm = norm
        return norm

    def zero_grad(self) -> None:
        self.cycle.advance("zero_grad")
        self.cycle_norm = self.verdict = None

    # -- the optimizer's hooks ------------------------------------------------------
    def before_step(self, optimizer) -> None:
        """The optimizer step's pre-hook (``optim.py``): gradients made final, checked
        per ``ZeroConfig.nonfinite``, and withheld from the optimizer on a skip."""
        if id(optimizer) not in self.checked:
            check_optimizer(optimizer, self.policy)
            if self.disk_step is not None:
                check_streamable(optimizer)
            attach(self, optimizer)  # its state dict speaks DTensor from now on
            self.checked.add(id(optimizer))
        if self.stepped_by not in (None, id(optimizer)):
            raise NotImplementedError(
                f"{type(optimizer).__name__}.step() after another optimizer's step with no "
                "backward in between: a sharded model hands each cycle's gradients to one "
                "optimizer step, and frees them after it. Put every parameter in one "
                "optimizer (param groups may differ in lr and weight decay)")
        if self.cycle.state in (CycleState.BACKWARD, CycleState.STEP):
            self.cycle.advance("step_begin")  # refused, with what was expected
        self.comm.phase = "step"
        self.events.emit("step_begin", optimizer=optimizer)  # the landing counts in the step
        self.finalize_grads()
        self.last_step_skipped = False
        if self._skips():  # an optimizer steps no parameter without .grad, on every rank
            for _, shard in self.named_shards:
                shard.grad = None
            self.last_step_skipped = True
            self.skipped_steps += 1
        if self.disk_step is not None:  # the step itself, streamed from the files; the
            self.disk_step.step(optimizer)  # optimizer's own step then finds no gradient
        self.cycle.advance("step_begin")
        self.stepped_by = id(optimizer)

    def _skips(self) -> bool:
        """Whether this step is skipped: a loss scaler's verdict, or the non-finite policy
        (one agreed exchange, or none when the cycle was clipped)."""
        if self.verdict is not None:  # a loss scaler has checked (and agreed) already
            return self.verdict[0] == "skip"
        if self.units[0].compute_dtype == torch.float16:
            raise ValueError(
                "mixed_precision='fp16': fp16 gradients overflow and underflow without "
                "dynamic loss scaling, and this step has none. Use scaler = "
                "zs.GradScaler(model); scaler.scale(loss).backward(); scaler.step(optimizer); "
                "scaler.update() — or mixed_precision='bf16'")
        if self.config.nonfinite == "ignore":
            return False
        problem = nonfinite.verdict(self.units, self.comm, self.cycle_norm, self.steps + 1)
        if problem is not None and self.config.nonfinite == "raise":
            raise nonfinite.NonFiniteGradients(problem)
        return problem is not None

    def after_step(self) -> None:
        """The optimizer step's post-hook: compute weights brought up to date."""
        self.cycle.advance("step_end")
        # All-gathers after the step go unit by unit; at most two are in flight, so the
        # gathered buffers never add up to a second copy of the model.
        prev = None
        for u in self.units:
            u.after_step(weights_updated=u.disk is not None)  # disk: the stream wrote them
            if prev is not None:
                prev.wait_sync()
            prev = u
        # the last one too: the module's full weights are current once step() returns,
        # as a DDP user reads them ([Note: module view]); on a GPU this orders the
        # streams, and the next forward would wait for it anyway
        prev.wait_sync()
        self.cycle_norm = self.verdict = None
        self.steps += 1
        self.comm.step, self.comm.phase = self.steps, "between steps"
        self.events.emit("step_end")
