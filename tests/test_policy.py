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
