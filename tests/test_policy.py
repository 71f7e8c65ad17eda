"""The policy (what a stage means) and the shape of the engine's tree: pure unit tests,
no process group. (The step cycle is in test_cycle.py, the dim-0 chunks in test_layout.py.)"""

import ast
from pathlib import Path

import pytest

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
