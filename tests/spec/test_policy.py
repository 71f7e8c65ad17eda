"""The policy (what a stage means): pure unit tests, no process group. (The step cycle is
in test_cycle.py, the dim-0 chunks in test_layout.py, the shape of the tree in
test_tree.py.)"""

import pytest

from zeroshard.spec.policy import AfterStep, FullGrads, ShardPolicy


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


@pytest.mark.parametrize("stage", range(4))
def test_the_planners_questions_and_the_page_table(stage):
    """What the planner (and its page, through ``as_dict``) asks instead of a stage number."""
    p = ShardPolicy.for_stage(stage)
    assert p.keeps_local_grads == (p.full_grads is FullGrads.LOCAL) == (stage == 1)
    assert p.averages_grads == (p.reduce == "all_reduce") == (stage == 0)
    assert p.gathers_after_step == (stage in (1, 2))
    assert p.shards_anything == (stage > 0)
    d = p.as_dict()
    assert d["shards"] == {"optimizer": stage >= 1, "grads": stage >= 2, "params": stage >= 3}
    assert (d["reduce"], d["after_step"], d["full_grads"]) == (
        p.reduce, p.after_step.value, p.full_grads.value)
    assert d["placement"] == {"params": "device", "grads": "device", "optimizer": "device"}


def test_at_stage_keeps_the_most_each_stage_takes():
    """``ZeroConfig.at_stage``: each rule of ``spec/rules.py`` read the other way; the
    result is a valid configuration at every stage (it is built, so checked)."""
    from zeroshard.spec.config import PLANNED_DISK, ZeroConfig

    full = ZeroConfig(stage=3, secondary_group=2, quantize_weights=True, quantize_grads=True,
                      offload="params", offload_dir=PLANNED_DISK)
    took = [(c.secondary_group, c.quantize_weights, c.quantize_grads, c.offload,
             c.policy.where("optimizer")) for c in map(full.at_stage, range(4))]
    assert took == [(None, False, False, None, "device"),
                    (None, False, True, "optimizer", "disk"),
                    (None, False, True, "optimizer", "disk"),
                    (2, True, True, "params", "disk")]
    assert full.at_stage(3) == full and ZeroConfig(stage=1).at_stage(3).stage == 3


def test_a_recipe_is_taken_whole():
    """A ``Recipe`` as ``mixed_precision`` keeps its own reduce dtype (the planner's
    recipes, custom bytes included); a named one takes the engine's default."""
    from zeroshard.spec.config import ZeroConfig
    from zeroshard.spec.recipes import get_recipe

    bf16 = get_recipe("bf16-mixed-adamw")
    assert ZeroConfig(mixed_precision=bf16).recipe == bf16  # reduced in bf16, as given
    assert ZeroConfig(mixed_precision="bf16-mixed-adamw").recipe.reduce_dtype == "fp32"
    assert ZeroConfig(mixed_precision=bf16, reduce_dtype="fp32").recipe.reduce_bytes == 4
    assert ZeroConfig(mixed_precision=get_recipe("2/2/12")).recipe.total_bytes == 16
    with pytest.raises(ValueError, match="reduce_dtype='fp32' asks for another reduction"):
        ZeroConfig(mixed_precision=bf16.with_reduce_dtype("fp32"), quantize_grads=True)
