"""ZeroShardStrategy on 2 gloo ranks against strategy="ddp" (gradient_clip_val,
accumulate_grad_batches=2, a per-step scheduler, decay groups by p.dim()): stages 1 and 3,
checkpoints resumed by ckpt_path= at the same and another stage, trainer.save_checkpoint
then validate, precision="bf16-mixed", the registered names."""

from __future__ import annotations

import pytest

from zeroshard.runtime.spawn import spawn

from . import lightning_cases
from .conftest import ok


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    return spawn(lightning_cases.main_grid, 2, str(tmp_path_factory.mktemp("pl")),
                 timeout=600)[0]


@pytest.mark.dist
@pytest.mark.parametrize("stage", [1, 3])
def test_stages_match_ddp(grid, stage):
    r = ok(grid["stages"])
    assert r[stage]["weights"] <= 1e-5, r[stage]
    assert r[stage]["val"] == pytest.approx(r["ddp_val"], rel=1e-6)


@pytest.mark.dist
def test_checkpoints_resume_exactly(grid):
    r = ok(grid["checkpoints"])
    assert r["saved"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    assert {"zeroshard", "meta.pt"} <= set(r["inside"])
    assert r[3] == 0.0  # resumed at the stage it was saved at: bit for bit
    assert r[1] <= 1e-6  # at another stage
    assert {"zeroshard", "meta.pt"} <= set(r["manual"])
    assert r["validate"][0] == pytest.approx(r["validate"][1], rel=1e-6)


@pytest.mark.dist
def test_bf16_mixed_runs_the_engine_recipe(grid):
    r = ok(grid["bf16"])
    assert r["recipe"] == "bf16-mixed-adamw" and r["dtypes"] == ["torch.bfloat16"]
    assert r["zeroshard"] == pytest.approx(r["ddp"], rel=2e-2)


@pytest.mark.dist
def test_registered_names(grid):
    assert ok(grid["names"]) == {"zeroshard": 3, "zeroshard_stage_0": 0,
                                 "zeroshard_stage_1": 1, "zeroshard_stage_2": 2,
                                 "zeroshard_stage_3": 3}
