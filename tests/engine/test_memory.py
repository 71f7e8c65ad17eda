"""Memory on real gloo processes at N = 2: ``model.memory()`` equals the planner's bytes
per category for every stage and both recipes; stage 3's persistence threshold keeps
small parameters whole; and a dropped model frees everything it held. (Uneven shards
and their padding at N = 3 are in test_layout.py.)"""

import pytest

from zeroshard.runtime.spawn import spawn

from . import engine_cases as cases

pytestmark = pytest.mark.dist


def _grid():
    return {"ledger": cases.ledger_grid(), "persistent": cases.persistence_grid(),
            "freed": cases.freed_when_dropped()}


@pytest.fixture(scope="module")
def grid():
    return spawn(_grid, 2, timeout=600)[0]


@pytest.mark.parametrize("precision", [None, "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_equals_plan_n2(grid, precision, stage):
    r = grid["ledger"][(precision, stage)]
    mem, (weights, grads, optimizer) = r["memory"], r["plan"]
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (weights, grads, optimizer)
    assert mem["padding"] == 0  # every dimension of the MLP divides by 2
    assert mem["gathered"] == 0


def test_persistence_threshold_keeps_small_parameters_whole(grid):
    r = grid["persistent"]
    # weights: every small parameter whole, the rest halved; gradients all sharded
    assert r["memory"]["params"] == 4 * (r["small"] + r["big"] // 2)
    assert r["memory"]["grads"] == 4 * (r["small"] + r["big"]) // 2
    # the persistent unit is never gathered: 4 gathered units x (forward + backward)
    assert r["units"] == 5 and r["gathers"] == 2 * 4


def test_dropped_model_is_freed_and_unhooked(grid):
    """No hook keeps a dropped engine alive: otherwise the collectives holding its
    process groups would live until interpreter teardown, where destroying the groups
    can abort the process. Its parameter hooks go with it."""
    assert all(all(v) for v in grid["freed"].values()), grid["freed"]
