"""Mixed precision (bf16 compute, fp32 master weights and reductions): the engine's recipe
is the planner's; on real gloo processes at N = 2 the stages agree bit for bit and track
the fp32 loss, and stage 0 bounds the fp32 reduction buffers it keeps in flight."""

import pytest

from zeroshard.runtime.spawn import spawn
from zeroshard.spec.config import ZeroConfig

from . import engine_cases as cases

# -- unit tests: no process group ----------------------------------------------------------


def test_planner_and_engine_share_the_recipe():
    from zeroshard.plan import RECIPES

    assert ZeroConfig(mixed_precision="bf16").recipe == RECIPES["bf16-mixed-adamw"] \
        .with_reduce_dtype("fp32")


# -- two gloo ranks: one spawn runs this file's grid ---------------------------------------


def _grid():
    return {"bf16": cases.bf16_grid(), "stage0_buffers": cases.bf16_stage0_buffers()}


@pytest.fixture(scope="module")
def grid():
    return spawn(_grid, 2, timeout=600)[0]


@pytest.mark.dist
def test_bf16_stages_agree_and_track_fp32(grid):
    r = grid["bf16"]
    assert all(r["bit_equal_to_stage0"]), r
    assert r["loss_gap"] < 2e-2, r
    first, last = r["loss_first_last"]
    assert last < first


@pytest.mark.dist
def test_stage0_bounds_wider_reductions_in_flight(grid):
    buffers, widest, units = grid["stage0_buffers"]
    assert units > 2 and 0 < buffers <= 2 * widest
