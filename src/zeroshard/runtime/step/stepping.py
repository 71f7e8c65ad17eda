"""The step side of a sharded model: gradients made final, clipped, checked for
non-finite values, handed to the optimizers, and the compute weights brought up to date
after them ([Note: the step cycle] in ``model/sharded.py``).

:class:`Stepper` is one collaborator of the model, owning the step's state (which shards
the optimizers stepped this cycle, the clipped norm, a loss scaler's verdict, the step
counters); the optimizer's global hooks (``optim.py``), ``zero_grad``,
``clip_grad_norm_`` and the loss scaler call its methods.

[Note: several optimizers] A cycle's gradients may be stepped by several optimizers
over disjoint parameters (Muon for the matrices, AdamW for the rest). Each shard is
stepped once a cycle; a unit's compute weights are brought up to date (the all-gather
of stages 1-2, the cast of stages 0 and 3) as soon as every shard of it that has a
gradient was stepped, so the last optimizer's post-hook ends the cycle. Shards no
optimizer steps (an optimizer over part of the model) are settled by the next forward,
backward or ``zero_grad()``. The first optimizer of a cycle takes
the decisions that are the cycle's: the step begins, the gradients are final, the
non-finite check (one exchange) says whether every optimizer skips.
"""

from __future__ import annotations

import torch

from ...offload.stream import DiskStep, check_streamable
from . import nonfinite
from .clip import check_clip_args, clip_grad_norm
from .cycle import CycleState, StepCycle
from .optim import sharded_step
from .optim_state import attach


class Stepper:
    """Before and after the optimizer steps of one sharded model."""

    def __init__(self, units, comm, reducer, cycle: StepCycle, policy, config, events,
                 named_shards):
        self.units, self.comm, self.reducer, self.cycle = units, comm, reducer, cycle
        self.policy, self.config, self.events = policy, config, events
        self.named_shards = named_shards  # (name, shard) in the module's order
        self.drivers: dict[int, object] = {}  # optimizer id -> its sharded step, or None
        self.stepped: dict[int, object] = {}  # shard id -> the optimizer that stepped it
        self.refreshed: set[int] = set()  # units whose compute weights caught up this cycle
        self.done = False  # this cycle's step ended: only optimizers with nothing left follow
        self.passing: object | None = None  # an optimizer stepping nothing of this model
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
        self.stepped.clear()
        self.refreshed.clear()
        self.done = False
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
        self.settle()
        self.cycle.advance("zero_grad")
        self.cycle_norm = self.verdict = None

    # -- the optimizer's hooks ------------------------------------------------------
    def before_step(self, optimizer) -> None:
        """The optimizer step's pre-hook (``optim.py``): gradients made final, checked
        per ``ZeroConfig.nonfinite``, withheld from the optimizer on a skip, and stepped
        by the engine where the optimizer cannot step rows alone (``optim.py``)."""
        if id(optimizer) not in self.drivers:
            self.drivers[id(optimizer)] = sharded_step(optimizer, self)
            if self.disk_step is not None:
                check_streamable(optimizer)
            attach(self, optimizer)  # its state dict speaks DTensor from now on
        ids = _param_ids(optimizer)
        other = next(((n, self.stepped[id(s)]) for n, s in self.named_shards
                      if id(s) in ids and self.stepped.get(id(s), optimizer) is not optimizer),
                     None)
        if other is not None:
            raise NotImplementedError(
                f"{type(optimizer).__name__}.step() steps {other[0]!r}, which "
                f"{type(other[1]).__name__}.step() stepped already since the last backward: "
                "each shard's gradient is consumed by one optimizer step and freed after it. "
                "Give each parameter to one optimizer (Muon for the matrices, AdamW for "
                "the rest; param groups may differ in lr and weight decay)")
        self.passing = None
        if self.done and self.cycle.state is CycleState.IDLE and not any(
                o is optimizer for o in self.stepped.values()):  # the cycle's step ended
            late = next((n for n, s in self.named_shards if id(s) in ids
                         and s.grad is not None), None)
            if late is not None:
                raise ValueError(
                    f"{type(optimizer).__name__}.step() after this cycle's step ended (a "
                    "forward or zero_grad() came after the other optimizers' steps), with "
                    f"a gradient on {late!r} it never stepped; expected every optimizer's "
                    "step() right after backward, before the next forward")
            self.passing = optimizer  # nothing of this model left for it to step
            return
        if self.cycle.state in (CycleState.BACKWARD, CycleState.STEP):
            self.cycle.advance("step_begin")  # refused, with what was expected
        first = self.cycle.state is not CycleState.PARTIAL
        self.comm.phase = "step"
        if first:
            self.events.emit("step_begin", optimizer=optimizer)  # the landing counts in it
        self.finalize_grads()
        if first:
            self.last_step_skipped = self._skips()
            if self.last_step_skipped:  # an optimizer steps no parameter without .grad
                for _, shard in self.named_shards:
                    shard.grad = None
                self.skipped_steps += 1
        driver = self.drivers[id(optimizer)]
        if driver is not None:  # the engine steps the rows with the whole-tensor sums or
            driver.step()  # matrices they need; the optimizer's own step finds no gradient
        if self.disk_step is not None:  # the step itself, streamed from the files; the
            self.disk_step.step(optimizer)  # optimizer's own step then finds no gradient
        self.cycle.advance("step_begin")

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

    def after_step(self, optimizer) -> None:
        """The optimizer step's post-hook: the units whose every shard with a gradient
        has been stepped get their compute weights brought up to date; the cycle ends
        when all have ([Note: several optimizers])."""
        if self.passing is optimizer:
            self.passing = None
            return
        for s in _param_ids(optimizer, self.named_shards):
            self.stepped[id(s)] = optimizer
        self._refresh([u for u in self.units if u.index not in self.refreshed and all(
            id(u.shards[i]) in self.stepped or u.shards[i].grad is None for i in u.trainable)])
        if len(self.refreshed) < len(self.units):
            self.cycle.advance("step_part")
            return
        self.cycle.advance("step_end")
        self._end_cycle()

    def settle(self) -> None:
        """End a cycle some optimizers stepped and none will step further: the rest of
        the units are brought up to date (their shards unchanged)."""
        if self.cycle.state is not CycleState.PARTIAL:
            return
        self._refresh([u for u in self.units if u.index not in self.refreshed])
        self.cycle.advance("settle")
        self._end_cycle()

    def _refresh(self, units) -> None:
        # All-gathers after the step go unit by unit; at most two are in flight, so the
        # gathered buffers never add up to a second copy of the model.
        prev = None
        for u in units:
            u.after_step(weights_updated=u.disk is not None)  # disk: the stream wrote them
            self.refreshed.add(u.index)
            if prev is not None:
                prev.wait_sync()
            prev = u
        # the last one too: the module's full weights are current once step() returns,
        # as a DDP user reads them ([Note: module view]); on a GPU this orders the
        # streams, and the next forward would wait for it anyway
        if prev is not None:
            prev.wait_sync()

    def _end_cycle(self) -> None:
        self.done = True
        self.cycle_norm = self.verdict = None
        self.steps += 1
        self.comm.step, self.comm.phase = self.steps, "between steps"
        self.events.emit("step_end")


def _param_ids(optimizer, named_shards=None):
    """The ids of the tensors ``optimizer`` steps; with ``named_shards``, those shards."""
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if named_shards is None:
        return ids
    return [s for _, s in named_shards if id(s) in ids]
