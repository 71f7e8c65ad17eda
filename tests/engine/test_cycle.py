"""The step cycle (backward, reduce, step, zero_grad) and its misuse. The state machine
accepts the ordinary loop and refuses anything else with an error that names what
happened and what was expected; on real gloo processes at N = 2 each misuse is one clear
error on every rank, never a hang, and so are models that differ between ranks."""

import pytest

from zeroshard.runtime.spawn import spawn
from zeroshard.runtime.stepping import CycleState, StepCycle

from . import engine_cases as cases

# -- unit tests: no process group ----------------------------------------------------------


def test_cycle_accepts_the_ordinary_loop():
    c = StepCycle()
    seq = ["backward_begin", "backward_end_unreduced",  # a micro-batch under no_sync
           "backward_begin", "backward_end", "finalize", "finalize",  # clip, then step
           "step_begin", "step_end", "zero_grad", "finalize", "step_begin", "step_end"]
    states = [c.advance(e) for e in seq]
    assert states == [CycleState.BACKWARD, CycleState.UNREDUCED, CycleState.BACKWARD,
                      CycleState.REDUCING, CycleState.FINAL, CycleState.FINAL, CycleState.STEP,
                      CycleState.IDLE, CycleState.IDLE, CycleState.FINAL, CycleState.STEP,
                      CycleState.IDLE]


@pytest.mark.parametrize("path, event, message", [
    (["backward_begin"], "finalize",
     "the gradients were read (optimizer.step() or clip_grad_norm_()) while the model is in "
     "state 'backward'; expected the backward pass to finish first"),
    (["backward_begin"], "zero_grad", "zero_grad() was called while the model is in state "
                                      "'backward'"),
    (["finalize", "step_begin"], "backward_begin",
     "a backward pass began while the model is in state 'step'; expected optimizer.step() "
     "to return first"),
    (["finalize", "step_begin"], "finalize", "in state 'step'"),
    ([], "step_begin", "optimizer.step() began while the model is in state 'idle'"),
])
def test_cycle_misuse_names_what_happened_and_what_was_expected(path, event, message):
    c = StepCycle()
    for e in path:
        c.advance(e)
    before = c.state
    with pytest.raises(ValueError) as exc:
        c.advance(event)
    assert message in str(exc.value)
    assert c.state is before  # a refused event changes nothing


# -- two gloo ranks: one spawn runs this file's grid ---------------------------------------


def _grid():
    return {"misuse": cases.misuse_grid(), "mismatch": cases.mismatched_models()}


@pytest.fixture(scope="module")
def grid():
    return spawn(_grid, 2, timeout=600)[0]


@pytest.mark.dist
def test_misuse_is_one_clear_error(grid):
    m = grid["misuse"]
    for key in ("shard_twice", "shard_inside"):
        assert m[key][0] == "ValueError" and "is already sharded" in m[key][1], m[key]
        assert "zs.shard() takes the original module once" in m[key][1]
    for stage in (0, 3):
        kind, msg = m[("step_in_backward", stage)]
        assert kind == "ValueError" and "while the model is in state 'backward'" in msg, msg
        assert "after loss.backward() returns" in msg
        kind, msg = m[("backward_in_step", stage)]
        assert "a backward pass began while the model is in state 'step'" in msg, msg
        # optimizers over disjoint parameters step one cycle (Muon and AdamW, as here
        # AdamW and SGD); one holding a parameter another stepped is refused
        assert m[("disjoint_optimizers", stage)] is None
        kind, msg = m[("two_optimizers", stage)]
        assert kind == "NotImplementedError" and "stepped already since the last backward" in msg
        assert "Give each parameter to one optimizer" in msg
        assert m[("after_refusal", stage)] == "idle"


@pytest.mark.dist
def test_different_models_are_named(grid):
    msg = grid["mismatch"]
    assert "rank 1's model differs from rank 0's: parameter 'inp.weight' (shape (10, 6)" in msg
