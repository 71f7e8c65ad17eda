"""Layout: how a model is cut into units and each unit's parameters into equal, padded
dim-0 shards. Unit tests pack, unpack and chunk without a process group; on real gloo
processes at N = 3, where shards are uneven, the stages still agree with DDP and each
other, and the padding is reported apart from the categories it pads."""

import pytest
import torch
import torch.nn as nn

from zeroshard.runtime.build import select_units
from zeroshard.runtime.spawn import spawn
from zeroshard.runtime.unit import ShardLayout
from zeroshard.spec.formulas import dim0_rows

from . import engine_cases as cases
from .engine_cases import MLP, Block

# -- unit tests: no process group ----------------------------------------------------------


def test_layout_shapes_padding_and_roundtrip():
    shapes = [(7, 3), (5,), ()]
    layout = ShardLayout(shapes, world=3)
    # 7 rows over 3 ranks: chunks of 3 rows -> rank 2 owns 1 real row + 2 padding rows
    assert [s.chunk_rows for s in layout.slots] == [3, 2, 1]
    assert layout.slot_numel == 9 + 2 + 1
    assert [layout.slots[0].shard_shape(r) for r in range(3)] == [(3, 3), (3, 3), (1, 3)]
    assert [layout.slots[2].shard_shape(r) for r in range(3)] == [(1,), (0,), (0,)]
    assert sum(layout.real_numel(r) for r in range(3)) == layout.numel == 21 + 5 + 1
    full = [torch.randn(7, 3), torch.randn(5), torch.randn(())]
    packed = torch.empty(3 * layout.slot_numel, dtype=torch.float64)
    layout.pack([t.reshape(s.rows, s.row_numel) for t, s in zip(full, layout.slots)], packed)
    back = layout.unpack(packed.view(3, -1))
    assert all(torch.equal(a.double(), b) for a, b in zip(full, back))
    views = layout.shard_views(packed.view(3, -1)[2].clone(), rank=2)
    assert torch.equal(views[0], full[0][6:7].double())


def test_one_chunk_arithmetic():
    """The layout's real rows are the chunks dim0_rows gives, at every rank."""
    for rows in (0, 1, 5, 7, 64):
        for world in (1, 3, 4, 8):
            layout = ShardLayout([(rows, 3)], world)
            chunks = [dim0_rows(rows, r, world) for r in range(world)]
            assert [b - a for a, b in chunks] == [layout.slots[0].real_rows(r)
                                                 for r in range(world)]
            assert chunks[0][0] == 0 and chunks[-1][1] == rows
            assert all(chunks[r][1] == chunks[r + 1][0] for r in range(world - 1))


def test_unit_policies():
    m = MLP()
    assert select_units(m, "blocks") == list(m.blocks)
    assert select_units(m, None) == []
    assert select_units(m, Block) == list(m.blocks)
    assert select_units(m, [m.blocks[0]]) == [m.blocks[0]]
    assert select_units(m, 170) == list(m.blocks)  # block 180 params; its Linear 156
    with pytest.raises(ValueError, match="units='layers' is not a unit policy"):
        select_units(m, "layers")
    with pytest.raises(ValueError, match="the model itself is always the root unit"):
        select_units(m, [m])
    with pytest.raises(ValueError, match="units=0 must be a positive parameter count"):
        select_units(m, 0)
    with pytest.raises(ValueError, match="Linear module is not part of the model"):
        select_units(m, [nn.Linear(2, 2)])


# -- three gloo ranks: one spawn runs this file's grid -------------------------------------


def _grid():
    return {"parity": cases.parity_grid(["mlp_odd"], ["plain", "accum"], steps=10),
            "ledger": cases.ledger_grid("mlp_odd")}


@pytest.fixture(scope="module")
def ranks():
    """Every rank's results: the memory test sums over ranks."""
    return spawn(_grid, 3, timeout=600)


@pytest.mark.dist
def test_parity_n3_with_padding(ranks):
    r = ranks[0]["parity"][("mlp_odd", "plain")]
    assert all(r["bit_equal_to_stage0"]) and max(r["diff_to_ddp"]) < cases.TOL, r
    # stage 0's default bucket (the whole model here) sums three ranks in another
    # order: within the tolerance of DDP, as DDP's own buckets are
    assert r["bucketed_to_ddp"] < cases.TOL and r["bucketed_to_stage0"] < cases.TOL, r
    r = ranks[0]["parity"][("mlp_odd", "accum")]
    assert max(r["diff_to_ddp"]) < cases.TOL and r["diff_to_ddp_every"][0] < cases.TOL, r


@pytest.mark.dist
@pytest.mark.parametrize("precision", [None, "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_equals_plan_n3(ranks, precision, stage):
    """At N = 3 shards are uneven: each category summed over ranks is the unsharded
    figure exactly, the planner's per-GPU figure is its ceiling share, and the padding
    that evens the slots is reported apart."""
    per_rank = [r["ledger"][(precision, stage)] for r in ranks]
    P, per = per_rank[0]["params"], per_rank[0]["bytes"]
    for k, cat in enumerate(("params", "grads", "optimizer")):
        sharded = stage >= {"optimizer": 1, "grads": 2, "params": 3}[cat]
        total = sum(r["memory"][cat] for r in per_rank)
        assert total == per[cat] * P * (1 if sharded else 3), cat
        assert per_rank[0]["plan"][k] == (-(-total // 3) if sharded else per[cat] * P), cat
    if stage >= 1:
        assert sum(r["memory"]["padding"] for r in per_rank) > 0
