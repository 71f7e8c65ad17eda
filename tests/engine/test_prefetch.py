"""Prefetch at stage 3 on real gloo processes at N = 2: the next unit's all-gather is
issued ahead of use in forward and in backward (where activation checkpointing
recomputes), without changing the weights or the number of gathers at any depth, also
when the execution order changes from step to step."""

import pytest

from zeroshard.runtime.spawn import spawn

from . import engine_cases as cases

pytestmark = pytest.mark.dist


def _grid():
    return {"prefetch": cases.prefetch_grid()}


@pytest.fixture(scope="module")
def grid():
    return spawn(_grid, 2, timeout=600)[0]


def test_prefetch_overlaps_without_changing_results(grid):
    r = grid["prefetch"]
    # (block 2, block 0) when block 1 starts: in forward, and again in backward, where
    # activation checkpointing recomputes it. Nothing is recorded on the first pass.
    assert set(r[0]["seen"]) == {("sharded", "sharded")}
    forward, backward = r[1]["seen"][0::2], r[1]["seen"][1::2]
    assert forward == [("sharded", "sharded")] + [("gathering", "sharded")] * 2
    assert backward == [("sharded", "sharded")] + [("sharded", "gathering")] * 2
    # the same weights and the same number of gathers at every depth
    assert cases.bit_equal(r[1]["weights"], r[0]["weights"])
    assert cases.bit_equal(r[2]["weights"], r[0]["weights"])
    assert r[0]["gathers"] == r[1]["gathers"] == r[2]["gathers"]
    assert cases.bit_equal(r["reorder"][1], r["reorder"][0])
