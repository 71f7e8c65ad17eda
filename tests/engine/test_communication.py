"""Communication on real gloo processes at N = 2: the bytes the ledger records equal the
planner's per stage and recipe (plus the presence flags), stage 3 sends exactly 1.5x
stage 0's bytes, and a reduce bucket coalesces units into one collective without
changing a bit. (The collectives themselves against torch's are in test_reduction.py.)"""

import pytest

from zeroshard.runtime.spawn import spawn

from . import engine_cases as cases

pytestmark = pytest.mark.dist


def _grid():
    return {"ledger": cases.ledger_grid(), "buckets": cases.bucket_grid()}


@pytest.fixture(scope="module")
def grid():
    return spawn(_grid, 2, timeout=600)[0]


@pytest.mark.parametrize("precision", [None, "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_comm_equals_plan_n2(grid, precision, stage):
    r = grid["ledger"][(precision, stage)]
    sent = _planned_kinds(r["comm"])
    # the engine adds one presence flag per parameter to each rank's slot of a reduction:
    # N·F flags, of which a reduce-scatter sends (N-1)/N and an all-reduce twice that
    flags = r["flag_bytes"] * (2 if stage == 0 else 1)
    assert sent - r["comm_plan"] == flags, (sent, r["comm_plan"], flags)
    comm = r["comm"]
    assert set(comm) - {"check"} == ({"all_reduce"} if stage == 0
                                     else {"reduce_scatter", "all_gather"})
    if stage == 3:
        assert comm["all_gather"]["calls"] == 2 * comm["reduce_scatter"]["calls"]
    # a fingerprint before every collective, and one agreement that the (unclipped) step's
    # gradients are finite (none at stage 0: every rank holds the same averaged gradients
    # and reaches the verdict alone); each 7 int64 gathered from 2 ranks: 56 bytes sent
    calls = sum(v["calls"] for k, v in comm.items() if k != "check") + (stage > 0)
    assert comm["check"] == {"calls": calls, "bytes": 56 * calls}


def _planned_kinds(comm: dict) -> int:
    """Bytes of the collectives the planner counts: all but the engine's checks."""
    return sum(v["bytes"] for kind, v in comm.items() if kind != "check")


def test_stage3_sends_one_and_a_half_times_ddp(grid):
    ledger = grid["ledger"]
    sent = {s: _planned_kinds(ledger[(None, s)]["comm"])
            - ledger[(None, s)]["flag_bytes"] * (2 if s == 0 else 1) for s in (0, 3)}
    assert sent[3] / sent[0] == 1.5


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reduce_bucket_coalesces_units(grid, stage):
    b = grid["buckets"]
    (alone, per_unit), (bucketed, per_bucket) = b[(stage, 0)], b[(stage, 10**9)]
    assert per_unit == 4 and per_bucket == 1  # root + 3 blocks, or one bucket
    assert cases.bit_equal(bucketed, alone)
    assert cases.bit_equal(bucketed, b[(0, 10**9)][0])
