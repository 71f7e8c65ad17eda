"""The planner under hybrid sharding (``shard_group`` K) against the engine's ledger.

``ENGINE`` is what the engine recorded at N = 4 as two shard groups of K = 2 (gloo, fp32
AdamW, ``engine_cases``' MLP, units by block: a step's memory per category on every
rank, and its bytes per level), unpadded (every row count divides by 2). The unit tests
replay it against the planner: memory per category is ``model_state_bytes`` at K,
bytes per level ``comm_bytes_by_level`` plus the presence flags the engine adds to each
reduced slot (the planner leaves them out). ``test_engine_still_records_these`` spawns
the engine and checks the record is still what it measures (a few seconds per rank).
"""

import pytest

from zeroshard.plan import ParallelDims, ZeroConfig, get_recipe
from zeroshard.plan.memory import (
    comm_bytes,
    comm_bytes_by_level,
    model_state_bytes,
    ring_all_reduce,
    ring_one_way,
    shard_degree,
)

FP32 = get_recipe("fp32-adamw")


def config(stage: int, recipe=FP32) -> ZeroConfig:
    """The planner's configuration: ``recipe`` taken whole (reduced in its own dtype)."""
    return ZeroConfig(stage=stage, mixed_precision=recipe)


def dims(gpus: int, k: int | None = None) -> ParallelDims:
    return ParallelDims(gpus, shard=k)
N, K, P = 4, 2, 650  # engine_cases.MLP(): 110 in the root unit, 180 in each of 3 blocks
#: Per unit, the reduced slot of one rank and its presence flags: (elements, flags).
UNITS = [(55, 4), (90, 4), (90, 4), (90, 4)]
#: Per stage: bytes per rank per category (every rank alike), bytes per level and kind.
ENGINE = {
    0: {"memory": {"params": 2600, "grads": 2600, "optimizer": 5200},
        "inside": {"all_reduce": 2728}, "across": {"all_reduce": 2728}},
    1: {"memory": {"params": 2600, "grads": 2600, "optimizer": 2600},
        "inside": {"reduce_scatter": 1364, "all_gather": 1300}, "across": {"all_reduce": 1364}},
    2: {"memory": {"params": 2600, "grads": 1300, "optimizer": 2600},
        "inside": {"reduce_scatter": 1364, "all_gather": 1300}, "across": {"all_reduce": 1364}},
    3: {"memory": {"params": 1300, "grads": 1300, "optimizer": 2600},
        "inside": {"reduce_scatter": 1364, "all_gather": 2600}, "across": {"all_reduce": 1364}},
}


def flag_bytes(stage: int) -> dict[str, int]:
    """The presence flags' bytes per level: F flags per unit in each of the K slots of a
    reduction (reduce-scatter: (K-1)/K of them sent, all-reduce twice that); across, each
    rank's F (stage 0: the whole buffer's K·F) all-reduced over the R replicas."""
    r, flags = FP32.reduce_bytes, sum(f for _, f in UNITS)
    inside = ring_one_way(r * K * flags, K) * (2 if stage == 0 else 1)
    across = sum(ring_all_reduce(r * f * (K if stage == 0 else 1), N // K) for _, f in UNITS)
    return {"inside": inside, "across": across}


def test_the_record_is_unpadded():
    assert K * sum(s for s, _ in UNITS) == P


@pytest.mark.parametrize("stage", range(4))
def test_memory_per_category_is_the_planners_at_k(stage):
    weights, grads, optimizer = model_state_bytes(P, dims(N, K), config(stage))
    assert ENGINE[stage]["memory"] == {"params": weights, "grads": grads,
                                       "optimizer": optimizer}
    assert (weights, grads, optimizer) == model_state_bytes(P, dims(K), config(stage))  # plain


@pytest.mark.parametrize("stage", range(4))
def test_bytes_per_level_are_the_planners_plus_flags(stage):
    planned = comm_bytes_by_level(P, dims(N, K), config(stage))
    flags = flag_bytes(stage)
    for level in ("inside", "across"):
        assert sum(ENGINE[stage][level].values()) == planned[level] + flags[level], level
    assert comm_bytes(P, dims(N, K), config(stage)) == sum(planned.values())


def test_levels_by_hand_70b_on_64_in_nodes_of_8():
    """Llama-2-70B's count, bf16 (r = w = 2), N = 64 as 8 nodes of 8."""
    p, bf16 = 68_976_648_192, get_recipe("bf16-mixed-adamw")
    z3 = comm_bytes_by_level(p, dims(64, 8), config(3, bf16))
    assert z3 == {"inside": 7 * (2 * p + 2 * 2 * p) // 8,  # reduce-scatter + 2 gathers over 8
                  "across": 2 * 7 * (2 * p // 8) // 8}  # 1/8 of the gradients over 8 replicas
    assert comm_bytes_by_level(p, dims(64, 8), config(0, bf16)) == {
        "inside": 2 * 7 * 2 * p // 8, "across": 2 * 7 * 2 * p // 8}
    plain = comm_bytes_by_level(p, dims(64), config(3, bf16))
    assert plain == {"inside": comm_bytes(p, dims(64), config(3, bf16)), "across": 0}
    assert model_state_bytes(p, dims(64, 8), config(3, bf16)) == model_state_bytes(
        p, dims(8), config(3, bf16))


@pytest.mark.parametrize("stage", range(4))
def test_degenerate_groups(stage):
    """K = N is plain sharding; K = 1 shards nothing (DDP's memory) and sends nothing
    inside, and stage 0 across all N is DDP's all-reduce."""
    p = 6_738_415_616
    bf16 = config(stage, get_recipe("bf16-mixed-adamw"))
    assert comm_bytes_by_level(p, dims(8, 8), bf16) == comm_bytes_by_level(p, dims(8), bf16)
    assert model_state_bytes(p, dims(8, 1), bf16) == model_state_bytes(p, dims(1),
                                                                       bf16.at_stage(0))
    one = comm_bytes_by_level(p, dims(8, 1), bf16)
    assert one["inside"] == 0 and one["across"] == ring_all_reduce(2 * p, 8)


def test_a_group_that_does_not_divide_is_named():
    with pytest.raises(ValueError, match=r"shard_group=3 gives shard groups of 3 ranks, which "
                                         r"do not divide the 8 data-parallel ranks; expected "
                                         r"one of \[1, 2, 4, 8\]"):
        shard_degree(8, 1, 3)
    with pytest.raises(ValueError, match="shard_group=0; expected None, an integer >= 1"):
        comm_bytes_by_level(1, dims(8, 0), config(3))
    with pytest.raises(ValueError, match="shard_group=4 in the ZeroConfig, but the layout "
                                         "shards over 8 ranks"):  # a bridge's two answers
        comm_bytes_by_level(1, dims(8), ZeroConfig(shard_group=4))
    assert shard_degree(16, 2, 4) == 4 and shard_degree(16, 2) == 8


def step_seeing_memory(net, opt) -> dict:
    """``opt.step()`` and ``zero_grad()``; returns ``net.memory(opt)`` as the step begins."""
    seen = []
    hook = opt.register_step_pre_hook(lambda o, a, kw: seen.append(net.memory(o)))
    opt.step()
    hook.remove()
    opt.zero_grad()
    return seen[0]


def _ledger(k: int) -> dict:
    """On each rank, per stage: memory per category at the second step (the optimizer
    state made by the first) and the bytes per level of that step."""
    import torch

    import zeroshard as zs

    from ..engine import engine_cases as cases

    out = {}
    for stage in range(4):
        net = zs.shard(cases.build("mlp"), stage=stage, shard_group=k, units="blocks")
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        for step in range(2):
            net.comm_stats(reset=True)
            net(*cases.batch("mlp", step)).backward()
            seen = step_seeing_memory(net, opt)
        levels = net.comm_stats(by_level=True)
        out[stage] = {"memory": {c: seen[c] for c in ("params", "grads", "optimizer")},
                      "units": [(u.r_layout.slot_numel, len(u.trainable)) for u in net.units],
                      **{lv: {kind: v["bytes"] for kind, v in levels.get(lv, {}).items()}
                         for lv in ("inside", "across")}}
    return out


@pytest.mark.dist
def test_engine_still_records_these():
    from zeroshard.runtime.spawn import spawn

    for rank in spawn(_ledger, N, K, timeout=300):
        assert all(r.pop("units") == UNITS for r in rank.values())
        assert rank == ENGINE
