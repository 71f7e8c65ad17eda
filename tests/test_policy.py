"""The policy, the step cycle and the shape of the engine's tree: pure unit tests, no
process group."""

import ast
from pathlib import Path

import pytest

from zeroshard.runtime.cycle import CycleState, StepCycle
from zeroshard.runtime.layout import ShardLayout, dim0_chunk
from zeroshard.runtime.policy import AfterStep, FullGrads, ShardPolicy

RUNTIME = Path(__file__).resolve().parents[1] / "src" / "zeroshard" / "runtime"


@pytest.mark.parametrize("stage, sharded, full, reduce, after", [
    (0, set(), FullGrads.AVERAGED, "all_reduce", AfterStep.CAST),
    (1, {"optimizer"}, FullGrads.LOCAL, "reduce_scatter", AfterStep.ALL_GATHER),
    (2, {"optimizer", "grads"}, FullGrads.FREED, "reduce_scatter", AfterStep.ALL_GATHER),
    (3, {"optimizer", "grads", "params"}, FullGrads.FREED, "reduce_scatter", AfterStep.CAST),
])
def test_policy_per_stage(stage, sharded, full, reduce, after):
    p = ShardPolicy.for_stage(stage)
    assert p.sharded == sharded
    assert (p.full_grads, p.reduce, p.after_step) == (full, reduce, after)
    assert p.keeps_full_grads == (stage <= 1)
    assert p.frees_grads_when_packed == (stage != 1)
    assert p.checks_elementwise == (stage >= 1)
    assert p.shard_coords(2, 4) == ((2, 4) if stage else (0, 1))
    assert all(p.where(c) == "device" for c in ("params", "grads", "optimizer"))
    # bf16 gradients summed in fp32: every stage bounds its reductions in flight;
    # in the gradients' own dtype stage 0 needs no bound
    assert p.bounds_reductions(2, 4)
    assert p.bounds_reductions(4, 4) == (stage > 0)


def test_whole_params_is_stage_two_inside_stage_three():
    p = ShardPolicy.for_stage(3).whole_params()
    assert p.sharded == ShardPolicy.for_stage(2).sharded
    assert p.after_step is AfterStep.ALL_GATHER and p.stage == 3


@pytest.mark.parametrize("stage", [4, -1, True, "3"])
def test_policy_refuses_a_non_stage(stage):
    with pytest.raises(ValueError, match="is not a ZeRO stage; expected 0, 1, 2 or 3"):
        ShardPolicy.for_stage(stage)


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


def test_one_chunk_arithmetic():
    """The layout's real rows are the chunks dim0_chunk gives, at every rank."""
    for rows in (0, 1, 5, 7, 64):
        for world in (1, 3, 4, 8):
            layout = ShardLayout([(rows, 3)], world)
            chunks = [dim0_chunk(rows, r, world) for r in range(world)]
            assert [b - a for a, b in chunks] == [layout.slots[0].real_rows(r)
                                                 for r in range(world)]
            assert chunks[0][0] == 0 and chunks[-1][1] == rows
            assert all(chunks[r][1] == chunks[r + 1][0] for r in range(world - 1))


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_runtime_never_imports_observe():
    """The engine emits events; the observatory listens. No arrow the other way."""
    for path in sorted(RUNTIME.glob("*.py")):
        bad = {m for m in _imports(path) if m.startswith("..observe")
               or m.startswith("zeroshard.observe")}
        assert not bad, f"{path.name} imports {bad}"


def test_runtime_files_stay_short():
    long = {p.name: n for p in RUNTIME.glob("*.py")
            if (n := len(p.read_text().splitlines())) > 320}
    assert not long, long


def test_only_the_policy_compares_stage_numbers():
    """Outside policy.py and config validation, nothing in the engine, the ledger,
    clipping, checkpoints or the profiler compares a stage number."""
    src = RUNTIME.parent
    for path in [*RUNTIME.glob("*.py"), *(src / "observe").glob("*.py"),
                 *(src / "checkpoint").glob("*.py")]:
        if path.name in ("policy.py", "config.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                names = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", None)
                         for n in [node.left, *node.comparators]}
                assert "stage" not in names, f"{path.name}:{node.lineno} compares a stage"
