"""The step cycle: where a sharded model is in its passes and its optimizer step, recorded
in one place. The collectives' fingerprints read the phase and the step count here, the
hooks and the stepper move it on, and the profiler's events follow it.
"""

from __future__ import annotations

import contextlib
import enum

# ----------------------------------------------------------------------------------------
# The step cycle as a state machine.
#
# [Note: the step cycle] One optimizer step consumes a *cycle* of one or more backward
# passes (gradient accumulation). The engine moves through the states below on the
# events it sees — backward begins and ends (autograd hooks), the gradients are made
# final (the step's pre-hook or ``clip_grad_norm_``), the step begins and ends (global
# optimizer hooks), ``zero_grad()`` — and any other order is a misuse, reported with
# what happened and what was expected (FSDP2's ``TrainingState`` plays the same role).
# ----------------------------------------------------------------------------------------

class CycleState(enum.Enum):
    """Where the engine is in the step cycle, and what gradient memory that implies."""

    IDLE = "idle"
    """No gradient of a new cycle yet (after construction, a step or ``zero_grad()``):
    the next backward starts a new cycle and overwrites what the last one left."""
    BACKWARD = "backward"
    """Inside a backward pass: units finish and their reductions are issued in order."""
    REDUCING = "reducing"
    """A synchronised backward has ended; its last reductions may still be in flight."""
    UNREDUCED = "unreduced"
    """A backward under ``no_sync()`` has ended: local gradients only, nothing issued."""
    FINAL = "final"
    """Every reduction has landed and each shard holds its gradient: inspect, clip,
    step."""
    STEP = "step"
    """Inside ``optimizer.step()``, between its pre- and post-hook."""
    PARTIAL = "partial"
    """Some optimizers have stepped this cycle's gradients and some shards that have a
    gradient are in none of them yet (Muon for the matrices, AdamW for the rest): the
    units whose every shard is stepped have their compute weights brought up to date;
    the rest wait for the other optimizers' steps, or for the next forward or
    ``zero_grad()``, which settle them (an optimizer over part of the model) and end
    the cycle."""


S = CycleState
#: event -> {state it may happen in: state it leads to}
_TRANSITIONS: dict[str, dict[CycleState, CycleState]] = {
    "backward_begin": {S.IDLE: S.BACKWARD, S.REDUCING: S.BACKWARD, S.UNREDUCED: S.BACKWARD,
                       S.FINAL: S.BACKWARD},
    "backward_end": {S.BACKWARD: S.REDUCING},
    "backward_end_unreduced": {S.BACKWARD: S.UNREDUCED},
    "finalize": {S.IDLE: S.FINAL, S.REDUCING: S.FINAL, S.UNREDUCED: S.FINAL, S.FINAL: S.FINAL,
                 S.PARTIAL: S.PARTIAL},
    "step_begin": {S.FINAL: S.STEP, S.PARTIAL: S.STEP},
    "step_end": {S.STEP: S.IDLE},
    "step_part": {S.STEP: S.PARTIAL},
    "settle": {S.PARTIAL: S.IDLE},
    "zero_grad": {S.IDLE: S.IDLE, S.REDUCING: S.IDLE, S.UNREDUCED: S.IDLE, S.FINAL: S.IDLE},
}

#: What each event is, in the words of the error that reports it out of order.
_WHAT = {
    "backward_begin": "a backward pass began",
    "backward_end": "a backward pass ended",
    "backward_end_unreduced": "a backward pass ended",
    "finalize": "the gradients were read (optimizer.step() or clip_grad_norm_())",
    "step_begin": "optimizer.step() began",
    "step_end": "optimizer.step() ended",
    "step_part": "optimizer.step() ended",
    "settle": "the cycle's step was settled",
    "zero_grad": "zero_grad() was called",
}

_EXPECTED = {
    S.BACKWARD: "the backward pass to finish first: call optimizer.step(), "
                "clip_grad_norm_() and zero_grad() after loss.backward() returns",
    S.STEP: "optimizer.step() to return first: no backward, clipping or zero_grad() "
            "from inside the optimizer's step",
    S.PARTIAL: "the step of the other optimizers holding this model's shards, or a "
               "forward, before another backward",
}


# [Note: generation] Sampling runs forwards until each sequence ends, so ranks whose
# sequences end at different lengths run different numbers of forwards. Stages 0-2 hold
# their weights whole and issue no collective in a forward: nothing to do. At stage 3
# every forward gathers each unit, and a rank done early would leave the others waiting
# in a gather until the timeout (DeepSpeed ZeRO-3 hangs so unless ``synced_gpus=True``).
# ``model.generate()`` meets it one of two ways (``ZeroConfig.generate_gather``): the
# whole model gathered once (``gathered()``: one all-gather per unit on entry, every
# rank at the same point; inside, the cycle is ``held`` and no forward issues a
# collective, so each rank runs as many as its sequences need; released on exit), or,
# where the full weights do not fit, unit by unit as in training with transformers'
# ``synced_gpus``, whose finished ranks keep running forwards (and serving gathers)
# until every rank is done. Training passes keep the out-of-step check: a backward
# inside the hold is refused.

#: Where a rank is, as its fingerprints say it ([Note: fingerprints] in ``watch.py``).
PHASES = ("setting up", "forward", "backward", "step", "between steps")

#: The phase each event leaves the model in (events not named leave it as it was).
_PHASE_AFTER = {"backward_begin": "backward", "step_end": "between steps",
                "settle": "between steps"}


class StepCycle:
    """Where one sharded model is: the :class:`CycleState` of its gradients, the phase of
    its passes, the optimizer steps it has taken, whether this cycle's step has ended,
    and whether ``gathered()`` holds its weights. Every field is written by the methods
    below, which the hooks and the stepper call; everything else reads them."""

    def __init__(self) -> None:
        self.state = CycleState.IDLE
        self.phase = PHASES[0]
        """One of :data:`PHASES`: the pass under way (the fingerprints' third field)."""
        self.steps = 0
        """Optimizer steps ended (skipped ones included): every rank counts alike."""
        self.stepped = False
        """This cycle's step has ended and no backward has begun since: an optimizer
        stepping now has nothing of this model left ([Note: several optimizers])."""
        self.held = False
        """Inside ``model.gathered()``: stage 3's full weights stay gathered."""

    def advance(self, event: str) -> CycleState:
        """Move on ``event``; a ValueError names the event, the state and the fix."""
        nxt = _TRANSITIONS[event].get(self.state)
        if nxt is None:
            expected = _EXPECTED.get(self.state, "a backward pass before the step")
            raise ValueError(f"zeroshard: {_WHAT[event]} while the model is in state "
                             f"{self.state.value!r}; expected {expected}")
        self.state = nxt
        self.phase = _PHASE_AFTER.get(event, self.phase)
        if event == "backward_begin":
            self.stepped = False
        elif event in ("step_end", "settle"):  # the cycle's last optimizer has stepped
            self.steps += 1
            self.stepped = True
        return nxt

    def ready(self) -> None:
        """The model is built: its set-up collectives are done."""
        self.phase = "between steps"

    def forward_begins(self) -> None:
        """A forward of the whole model begins (not a recompute inside backward)."""
        self.phase = "forward"

    def step_begins(self) -> None:
        """An optimizer's step begins: the landing of the last reductions and the
        step's own collectives are the step's, before its state is entered."""
        self.phase = "step"

    @contextlib.contextmanager
    def holding(self):
        """``model.gathered()``: the full weights held for the context."""
        self.held = True
        try:
            yield
        finally:
            self.held = False

    @property
    def new_cycle(self) -> bool:
        """The next backward starts a new cycle."""
        return self.state is CycleState.IDLE
