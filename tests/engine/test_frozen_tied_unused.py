"""Frozen, tied and unused parameters. The planner counts a tied weight once; on real
gloo processes at N = 2 a branch no rank takes and a frozen parameter never change, a
branch only rank 0 takes does, and no rank hangs, at every stage. (Tied weights in
different units, a frozen embedding and a block skipped on odd steps are trained
against DDP in test_models.py.)"""

import pytest

from zeroshard.runtime.spawn import spawn

from . import engine_cases as cases

# -- unit tests: no process group ----------------------------------------------------------


def test_planner_counts_a_module_with_tied_weights_once():
    from zeroshard.models.gpt import GPT, get_preset
    from zeroshard.plan import ModelSpec

    spec = ModelSpec.from_module(GPT(get_preset("small")))
    assert spec.params == 842_496  # the head shares the embedding: counted once


# -- two gloo ranks: one spawn runs this file's grid ---------------------------------------


def _grid():
    return {"branchy": cases.unused_frozen_grid()}


@pytest.fixture(scope="module")
def grid():
    return spawn(_grid, 2, timeout=600)[0]


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unused_and_frozen_parameters(grid, stage):
    r = grid["branchy"][stage]
    assert r["never_changed"] and not r["frozen_changed"] and r["rank0_only_changed"]
    assert r["never_changed_accum"]
    assert cases.bit_equal(r["weights"], grid["branchy"][0]["weights"])
