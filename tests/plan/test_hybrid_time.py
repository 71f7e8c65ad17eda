"""Hybrid sharding in the step-time model, ``--recommend`` and ``zeroshard plan``: the
group's collectives on the link of its GPUs, the replicas' all-reduce on the link
between groups and on the compute path (the engine waits for it as it lands a
reduction), and the recommendation weighing groups of whole nodes against plain
sharding, with its reason and hybrid runners-up."""

import json

import pytest

from zeroshard.cli import main
from zeroshard.plan import ModelSpec, ParallelDims, Workload, get_preset, plan_strategy
from zeroshard.plan.hardware import Accelerator, Cluster, Link, Network, get_network
from zeroshard.plan.memory import comm_bytes_by_level, model_state_bytes
from zeroshard.plan.peak import peak
from zeroshard.plan.recommend import recommend, shard_groups
from zeroshard.plan.steptime import Schedule, ring_time, step_time

from .test_time import (
    CAST0,
    LAND0,
    MS,
    PACK,
    TOY,
    TOY_LINK,
    WORK,
    config,
    optimizer,
)

#: The toy cluster of test_plan_time as 2 nodes of 2: 1 GB/s inside a node, ``inter``
#: between nodes.
ACC = Accelerator("toy", (2 * 10**6 + 16) * 1000 / 4 / (0.5 * MS), 1e12, efficiency=1.0)


def nodes(inter: Link) -> Cluster:
    return Cluster(ACC, Network("toy", TOY_LINK, inter), gpus_per_node=2)


def test_links_inside_a_node_and_between_replicas():
    c = Cluster(ACC, get_network("nvlink4-ndr"), gpus_per_node=8)
    assert c.link(8).name == "NVLink 4"  # a group of one node
    assert c.link(8, stride=8).name == "InfiniBand NDR 400G"  # its replicas: a GPU a node
    assert c.link(4, stride=2).name == "NVLink 4"  # replicas inside one node
    assert c.link(16).bandwidth == 50e9  # a group of two nodes


def test_stage0_in_groups_lands_every_replica_all_reduce_on_the_compute_path():
    # unit by unit, 4 ranks as 2 x 2: each unit's all-reduce over the 2 ranks of a node
    # (0.5 ms) hides behind backward as at N = 2; at the end of backward each landing waits for the
    # all-reduce of the whole buffer (500 kB) across the 2 nodes, 0.5 ms at 1 GB/s, in
    # turn: 4 x 0.5 ms exposed, the last inside all-reduce hidden behind the first three
    t = step_time(TOY, ParallelDims(4, shard=2), config(0, reduce_bucket_size=0), WORK,
                  nodes(TOY_LINK))
    assert t.across == pytest.approx(4 * 0.5 * MS)
    assert t.step == pytest.approx(6 * MS + 4 * PACK + 4 * LAND0 + 2 * MS + 4 * CAST0
                                   + optimizer(0))
    assert t.exposed == pytest.approx(2 * MS)
    assert t.comm == pytest.approx(4 * 0.5 * MS + 2 * MS)


@pytest.mark.parametrize("stage", range(4))
def test_inside_a_group_is_plain_sharding_over_k(stage):
    """With a free link between groups, 2 x 2 runs as plain sharding over 2; the
    across seconds (the reduced slot, 250 kB from stage 1, over 2) sit on the compute
    path: each adds to the exposed time."""
    free = nodes(Link("free", 1e30, 0.0))
    plain = step_time(TOY, ParallelDims(2), config(stage), WORK, free)
    hybrid = step_time(TOY, ParallelDims(4, shard=2), config(stage), WORK, free, Schedule())
    for field in ("step", "compute", "copies", "optimizer", "comm", "exposed"):
        assert getattr(hybrid, field) == pytest.approx(getattr(plain, field), abs=1e-12), field
    slow = step_time(TOY, ParallelDims(4, shard=2), config(stage), WORK, nodes(TOY_LINK))
    slot = 500_000 / (1 if stage == 0 else 2)
    assert slow.across == pytest.approx(4 * ring_time("all_reduce", slot, 2, TOY_LINK))
    assert slow.exposed >= slow.across - 1e-12
    assert slow.step > plain.step


def test_a_plain_group_is_plain():
    c = Cluster(ACC, get_network("nvlink4-ndr"))
    model = ModelSpec.from_arch(get_preset("llama2-7b"))
    work = Workload(2048)
    for stage in range(4):
        assert step_time(model, ParallelDims(16, shard=16), config(stage), work, c) == \
            step_time(model, ParallelDims(16), config(stage), work, c)
        assert step_time(model, ParallelDims(16, shard=16), config(stage, shard_group=16),
                         work, c) == step_time(model, ParallelDims(16), config(stage), work, c)
    with pytest.raises(ValueError, match="shard_group=0; expected None, an integer >= 1"):
        config(3, shard_group=0)
    with pytest.raises(ValueError, match="shard_group=3 gives shard groups of 3 ranks, which "
                                         "do not divide the 16"):
        step_time(model, ParallelDims(16, shard=3), config(3), work, c)


M70 = ModelSpec.from_arch(get_preset("llama2-70b"))
H100 = Cluster(Accelerator("h100", 989e12, 3.35e12), get_network("nvlink4-ndr"))


def test_70b_on_64_h100s_plain_zero3_against_groups_of_a_node():
    """The report's figures: memory, bytes per level and peak, plain and K = 8."""
    work, on64, in8 = Workload(2048), ParallelDims(64), ParallelDims(64, shard=8)
    plain = plan_strategy(M70, on64, config(3), work)
    node = plan_strategy(M70, in8, config(3), work)
    assert (round(plain.total / 1e9, 2), round(node.total / 1e9, 2)) == (22.42, 143.13)
    assert node.weights + node.grads + node.optimizer == sum(model_state_bytes(
        M70.params, ParallelDims(8), config(3)))
    assert (plain.comm_inside, plain.comm_across) == (plain.comm, 0)
    assert {"inside": node.comm_inside, "across": node.comm_across} == comm_bytes_by_level(
        M70.params, in8, config(3))
    assert round(node.comm_across / 1e9, 2) == 30.18 and round(node.comm / 1e9, 2) == 392.30
    assert peak(M70, in8, config(3), work).bytes == peak(M70, ParallelDims(8), config(3),
                                                          work).bytes


def test_recommend_weighs_groups_of_nodes_and_keeps_plain_on_nvlink_ndr():
    """With full checkpointing fixed (weighed too, selective checkpointing at TP 8 wins:
    ``test_time.py``)."""
    rec = recommend(M70, config(), 64, 80 * 10**9, H100, 1024, 2048, checkpointing="full")
    b = rec.best
    assert (b.strategy, b.tp, b.shard_group) == ("ZeRO-3", 1, None)
    why = rec.reasons["shard group"]
    assert why.startswith("all 64 data-parallel ranks (plain ZeRO-3)")
    assert "groups of 8 does not fit (needs 206.93 GB or more)" in why
    assert "groups of 32 +" in why
    assert any(c.shard_group is not None for c in rec.runners_up)
    assert shard_groups(64, 1, H100) == [8, 16, 32] and shard_groups(64, 2, H100) == [4, 8, 16]


def test_recommend_takes_a_node_group_on_slow_links():
    """13B on 256 GPUs over PCIe and 100 GbE RoCE: plain ZeRO-3's gathers cross RoCE;
    in groups of a node they stay on PCIe and 1/8 of the gradients crosses."""
    m13 = ModelSpec.from_arch(get_preset("llama2-13b"))
    roce = Cluster(H100.accelerator, get_network("pcie4-roce"))
    rec = recommend(m13, config(), 256, 80 * 10**9, roce, 1024, 2048)
    b = rec.best
    assert (b.strategy, b.shard_group) == ("ZeRO-3", 8)
    assert rec.reasons["shard group"].startswith(
        "8 (ZeRO-3 inside groups of 8 GPUs on PCIe 4.0 x16, replicated 32 times")
    assert "; plain +" in rec.reasons["shard group"]
    assert any(c.shard_group is None for c in rec.runners_up)
    assert rec.as_dict()["best"]["shard_group"] == 8


def test_recommend_with_a_fixed_group():
    rec = recommend(M70, config(shard_group=32), 64, 80 * 10**9, H100, 1024, 2048, tp=1)
    assert {c.shard_group for c in (rec.best, *rec.runners_up)} == {32}
    assert rec.reasons["shard group"].endswith("the only layout tried")
    none = recommend(M70, config(shard_group="node"), 64, 80 * 10**9, H100, 1024, 2048)
    assert none.best is None
    assert "in shard groups of a node (8 GPUs): even ZeRO-3" in none.reasons["none"]


def test_plan_cli_by_level(capsys):
    assert main(["plan", "--model", "llama2-70b", "--gpus", "64", "--shard-group", "node",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    z3 = out["strategies"][3]
    assert out["shard_group"] == 8 and z3["shard_group"] == 8
    assert {"inside": z3["comm_inside"], "across": z3["comm_across"]} == comm_bytes_by_level(
        M70.params, ParallelDims(64, shard=8), config(3))
    assert z3["peak"]["peak"] == peak(M70, ParallelDims(8), config(3), Workload(2048)).bytes
    assert main(["plan", "--model", "llama2-13b", "--gpus", "64", "--shard-group", "8",
                 "--time"]) == 0
    text = capsys.readouterr().out
    assert "shard groups of 8 (8 replicas)" in text and "across GB" in text
    assert "across s" in text
    assert main(["plan", "--model", "llama2-70b", "--gpus", "64", "--shard-group", "8"]) == 0
    assert "nothing fits in shard groups of 8 on 64 GPUs; ZeRO-3 fits in groups of 16" in \
        capsys.readouterr().out.replace("\n", " ")


@pytest.mark.parametrize("argv,message", [
    (["--shard-group", "3"], "--shard-group=3 does not divide the 8 data-parallel ranks; "
                             "expected one of [1, 2, 4, 8]"),
    (["--shard-group", "x"], "--shard-group='x' must be a positive integer or 'node'"),
    (["--shard-group", "0"], "--shard-group=0 must be a positive integer or 'node'"),
    (["--shard-group", "4", "--min-gpus"], "--min-gpus searches GPU counts for plain"),
])
def test_bad_groups_are_one_line(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
