"""The planner's offload (``plan/placement.py``) against the engine's ledger by placement.

``ENGINE`` is what ``model.memory(optimizer, by_placement=True)`` reported in a step
pre-hook at the second step on each of N = 2 gloo ranks (``engine_cases``' MLP, units by
block, AdamW; every slot unpadded, both ranks alike), for stages 1-3 with and without
``offload="optimizer"`` and at stage 3 with ``offload="params"``, fp32 and bf16. The
unit tests replay it against ``placed_bytes``; ``test_engine_still_records_these``
spawns the engine and checks the record is still what it measures.
"""

import json

import pytest

import zeroshard as zs
from zeroshard.plan import PLANNED_DISK, ParallelDims, ZeroConfig, get_recipe
from zeroshard.plan.placement import (
    SUB_GROUP_SIZE,
    disk_io_bytes,
    host_step_bytes,
    pcie_bytes,
    placed_bytes,
    sub_group_buffers,
)

N, P = 2, 650
RECIPES = {None: get_recipe("fp32-adamw"), "bf16": get_recipe("bf16-mixed-adamw")}


def config(recipe, stage=3, offload=None, **options) -> ZeroConfig:
    """The planner's configuration: ``recipe`` taken whole (reduced in its own dtype)."""
    return ZeroConfig(stage=stage, mixed_precision=recipe, offload=offload, **options)
#: (precision, stage, offload) -> {"device": {...}, "host": {...}}, zero categories left out
ENGINE = {
    (None, 1, None): ({"params": 2600, "grads": 2600, "optimizer": 2600, "buffers": 1300}, {}),
    (None, 1, "optimizer"): ({"params": 2600, "grads": 2600, "buffers": 1300},
                             {"optimizer": 3900, "buffers": 1300}),
    (None, 2, None): ({"params": 2600, "grads": 1300, "optimizer": 2600}, {}),
    (None, 2, "optimizer"): ({"params": 2600, "grads": 1300},
                             {"optimizer": 3900, "buffers": 1300}),
    (None, 3, None): ({"params": 1300, "grads": 1300, "optimizer": 2600}, {}),
    (None, 3, "optimizer"): ({"params": 1300, "grads": 1300},
                             {"optimizer": 3900, "buffers": 1300}),
    (None, 3, "params"): ({"grads": 1300},
                          {"params": 1300, "optimizer": 3900, "buffers": 1300}),
    ("bf16", 1, None): ({"params": 1300, "grads": 1300, "optimizer": 3900, "buffers": 1950},
                        {}),
    ("bf16", 1, "optimizer"): ({"params": 1300, "grads": 1300, "buffers": 650},
                               {"optimizer": 3900, "buffers": 1300}),
    ("bf16", 2, None): ({"params": 1300, "grads": 650, "optimizer": 3900, "buffers": 1300}, {}),
    ("bf16", 2, "optimizer"): ({"params": 1300, "grads": 650},
                               {"optimizer": 3900, "buffers": 1300}),
    ("bf16", 3, None): ({"params": 650, "grads": 650, "optimizer": 3900, "buffers": 1300}, {}),
    ("bf16", 3, "optimizer"): ({"params": 650, "grads": 650},
                               {"optimizer": 3900, "buffers": 1300}),
    ("bf16", 3, "params"): ({"grads": 650},
                            {"params": 650, "optimizer": 3900, "buffers": 1300}),
}


#: Disk offload (``offload_dir``, one sub-group: ``SUB`` >= the 325 owned elements):
#: (precision, stage) -> (device, host, disk), as ``ENGINE``.
SUB = 1000
DISK = {
    (precision, stage): (ENGINE[(precision, stage, "optimizer")][0],
                         {"buffers": 1300 + 3900}, {"optimizer": 3900})
    for precision in (None, "bf16") for stage in (1, 2, 3)
}


def planned(precision, stage, offload) -> tuple[dict, dict]:
    """``placed_bytes`` in the ledger's names, zero categories left out."""
    placed = placed_bytes(P, ParallelDims(N), config(RECIPES[precision], stage, offload))

    def named(b):
        out = {"params": b.weights, "grads": b.grads, "optimizer": b.optimizer,
               "buffers": b.buffers}
        return {k: v for k, v in out.items() if v}

    return named(placed.device), named(placed.host)


@pytest.mark.parametrize("case", list(ENGINE), ids=str)
def test_placement_is_the_engines(case):
    assert planned(*case) == ENGINE[case]


def _named(b) -> dict:
    out = {"params": b.weights, "grads": b.grads, "optimizer": b.optimizer,
           "buffers": b.buffers}
    return {k: v for k, v in out.items() if v}


@pytest.mark.parametrize("case", list(DISK), ids=str)
def test_disk_placement_is_the_engines(case):
    """The host keeps the fp32 gradients and one sub-group buffer of 12 bytes an owned
    element (two once the partition makes two sub-groups); the disk the master and
    both moments."""
    precision, stage = case
    placed = placed_bytes(P, ParallelDims(N), config(
        RECIPES[precision], stage, "optimizer", offload_dir=PLANNED_DISK, sub_group_size=SUB))
    assert (_named(placed.device), _named(placed.host), _named(placed.disk)) == DISK[case]


def test_sub_group_buffers_by_hand():
    """Two buffers of 12 bytes an element once there are two sub-groups:
    test_offload_disk.py measures 24 000 bytes for the GPT case's 10 512 owned elements
    in sub-groups of 1000."""
    assert sub_group_buffers(10_512, 12, 1000) == 2 * 12 * 1000
    assert sub_group_buffers(1500, 12, 1000) == 2 * 12 * 1000
    assert sub_group_buffers(325, 12, 1000) == 12 * 325
    assert SUB_GROUP_SIZE == zs.ZeroConfig().sub_group_size
    with pytest.raises(ValueError, match="sub_group_size=0 must be an integer >= 1"):
        sub_group_buffers(10, 12, 0)
    p, bf16 = 68_976_648_192, RECIPES["bf16"]
    disk = config(bf16, 3, "optimizer", offload_dir=PLANNED_DISK)
    assert disk_io_bytes(p, ParallelDims(8), disk) == {"read": 12 * p // 8,
                                                       "write": 12 * p // 8}


def test_offload_changes_where_not_how_much_on_the_device():
    """Offloaded, the device keeps the weights (not with params) and the gradients it
    kept; the host holds a master even in fp32 (4 + 8 bytes an element) and the fp32
    gradient copy."""
    for (precision, stage, offload), (device, host) in ENGINE.items():
        if offload is None:
            continue
        plain = ENGINE[(precision, stage, None)][0]
        assert device["grads"] == plain["grads"]
        assert host["optimizer"] == 12 * P // N
        assert host["buffers"] == 4 * P // N


def _placed(precision, stage, wheres, **offload):
    """What ``memory(by_placement=True)`` says in a step pre-hook at the second step."""
    import torch

    import zeroshard as zs

    from ..engine import engine_cases as cases

    net = zs.shard(cases.build("mlp"), stage=stage, mixed_precision=precision, units="blocks",
                   **offload)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused="offload_dir" in offload)
    for step in range(2):
        net(*cases.batch("mlp", step)).backward()
        seen = []
        hook = opt.register_step_pre_hook(
            lambda o, a, kw, seen=seen, net=net: seen.append(net.memory(o, True)))
        opt.step()
        hook.remove()
        opt.zero_grad()
    return tuple({c: b for c, b in seen[0][where].items() if b} for where in wheres)


def _grid(root):
    out = {(precision, stage, offload): _placed(precision, stage, ("device", "host"),
                                                offload=offload)
           for precision, stage, offload in ENGINE}
    for precision, stage in DISK:
        out[(precision, stage)] = _placed(precision, stage, ("device", "host", "disk"),
                                          offload="optimizer", offload_dir=root,
                                          sub_group_size=SUB)
    return out


@pytest.mark.dist
def test_engine_still_records_these(tmp_path):
    from zeroshard.runtime.spawn import spawn

    for rank in spawn(_grid, N, str(tmp_path), timeout=300):
        assert rank == {**ENGINE, **DISK}


def test_pcie_and_host_step_by_hand():
    """Llama-2-70B's count on 8 GPUs, bf16 (w = 2, m = 4), 4 micro-batches."""
    p, bf16, on8 = 68_976_648_192, RECIPES["bf16"], ParallelDims(8)
    n = p // 8
    assert pcie_bytes(p, on8, config(bf16, 3, "optimizer"), micro_batches=4) == {
        "down": 4 * 4 * n, "up": 2 * n}
    assert pcie_bytes(p, on8, config(bf16, 3, "params"), micro_batches=4) == {
        "down": 4 * 4 * n, "up": 2 * 4 * 2 * n}
    assert pcie_bytes(p, on8, config(bf16, 2)) == {"down": 0, "up": 0}
    assert host_step_bytes(bf16) == 30  # docs/offload.md: 28 + the bf16 cast
    assert host_step_bytes(RECIPES[None]) == 28
    assert placed_bytes(p, on8, config(bf16, 3, "optimizer")).host_per_node(8) == 8 * 16 * n


@pytest.mark.parametrize("offload,stage,message", [
    ("optimizer", 0, "stage 0 shards nothing: use stage 1-3"),
    ("params", 2, "offload='params' keeps the weight shards on the host, which only "
                  "stage 3 has"),
    ("nvme", 3, "offload='nvme'; expected None, 'optimizer' or 'params'"),
])
def test_bad_offload_in_the_engines_words(offload, stage, message):
    """The planner's input is the engine's ``ZeroConfig``: its refusal, its words."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        config(RECIPES[None], stage, offload)


def test_each_strategy_takes_what_it_can():
    """``ZeroConfig.at_stage``: the most of the offload each stage takes, the disk with
    it (the plan table's rows)."""
    both = config(RECIPES[None], 3, "params", offload_dir=PLANNED_DISK)
    assert [both.at_stage(s).offload for s in range(4)] == [None, "optimizer", "optimizer",
                                                            "params"]
    assert [both.at_stage(s).offload_dir for s in range(4)] == [None] + [PLANNED_DISK] * 3
    assert [both.at_stage(s).policy.where("optimizer") for s in range(4)] == [
        "device", "disk", "disk", "disk"]
    assert [config(RECIPES[None]).at_stage(s).offload for s in range(4)] == [None] * 4


def _plan(capsys, *argv):
    from zeroshard.cli import main

    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def test_cli_json_by_placement(capsys):
    out = json.loads(_plan(capsys, "--params", "1000", "--gpus", "2", "--precision",
                           "fp32-adamw", "--offload", "optimizer", "--gpus-per-node", "4",
                           "--json"))
    z1 = out["strategies"][1]
    assert z1["offload"] == "optimizer" and z1["optimizer"] == 0
    assert z1["placement"]["host"] == {"weights": 0, "grads": 0, "optimizer": 6000,
                                       "buffers": 2000, "total": 8000}
    assert z1["host"] == 8000 and z1["host_per_node"] == 4 * 8000
    assert z1["pcie"] == {"down": 2000, "up": 2000}
    assert out["strategies"][0]["offload"] is None


def test_cli_json_on_disk(capsys):
    out = json.loads(_plan(capsys, "--params", "1000", "--gpus", "2", "--precision",
                           "fp32-adamw", "--offload", "optimizer", "--offload-dir",
                           "--sub-group-size", "100", "--gpus-per-node", "4", "--json"))
    z1 = out["strategies"][1]
    assert z1["placement"]["disk"] == {"weights": 0, "grads": 0, "optimizer": 6000,
                                       "buffers": 0, "total": 6000}
    assert z1["placement"]["host"]["buffers"] == 2000 + 2 * 12 * 100  # grads + 2 sub-groups
    assert z1["host"] == 4400 and z1["disk_per_node"] == 4 * 6000
    assert z1["disk_io"]["read"] == z1["disk_io"]["write"] == 6000
    assert z1["disk_io"]["seconds"] == pytest.approx(12000 / z1["disk_io"]["bandwidth"])
    assert z1["placement"]["device"] == out["strategies"][2]["placement"]["device"] | {
        "grads": 4000, "total": 10000, "buffers": 2000}


def test_offload_dir_needs_offload(capsys):
    from zeroshard.cli import main

    assert main(["plan", "--params", "1000", "--gpus", "2", "--offload-dir"]) != 0
    assert ("--offload-dir keeps the offloaded optimizer state on disk: add --offload "
            "optimizer (or params)") in capsys.readouterr().err


def test_step_time_charges_pcie_and_the_host_step():
    """Nothing overlaps on the loopback preset, so the step is the sum of its parts: the
    PCIe copies (A·m·n down per step, w·n up at stage 3) and the host step (30 bytes an
    owned element at the node's host bandwidth over its GPUs) are in it."""
    from zeroshard.plan import (
        Cluster,
        ModelSpec,
        Schedule,
        Workload,
        get_accelerator,
        get_network,
        get_preset,
        step_time,
    )
    from zeroshard.plan.hardware import get_host

    model = ModelSpec.from_arch(get_preset("llama2-7b"))
    host = get_host("pcie5", 400e9)
    cluster = Cluster(get_accelerator("h100"), get_network("loopback"), 4, host)
    work, bf16, on8 = Workload(4096, 4096), RECIPES["bf16"], ParallelDims(8)
    two = Schedule(micro_batches=2)
    plain = step_time(model, on8, config(bf16), work, cluster, two)
    off = step_time(model, on8, config(bf16, 3, "optimizer"), work, cluster, two)
    n = model.params / 8
    assert off.pcie == pytest.approx((2 * 4 * n + 2 * n) / 55e9)
    assert off.optimizer == pytest.approx(n * 30 / (400e9 / 4))
    assert off.step == pytest.approx(off.compute + off.tp_comm + off.optimizer + off.copies
                                     + off.comm + off.pcie)
    assert plain.pcie == 0 and off.compute == plain.compute and off.comm == plain.comm
    params = step_time(model, on8, config(bf16, 3, "params"), work, cluster, two)
    assert params.pcie == pytest.approx((2 * 4 * n + 2 * 2 * 2 * n) / 55e9)


def test_recommend_offers_offload_only_when_nothing_else_fits():
    from zeroshard.plan import (
        Cluster,
        ModelSpec,
        get_accelerator,
        get_network,
        get_preset,
        recommend,
    )

    cluster = Cluster(get_accelerator("h100"), get_network("nvlink4-ndr"))
    big = recommend(ModelSpec.from_arch(get_preset("llama2-70b")), config(RECIPES["bf16"]),
                    8, 80 * 10**9, cluster, 64, 2048)
    assert big.best.offload == "optimizer" and big.best.stage == 3
    why = big.reasons["offload"]
    assert why.startswith("optimizer: nothing fits 72.00 GB on the device without it")
    assert f"{big.best.time.pcie:.3f} s on the compute path" in why
    assert f"host step takes {big.best.time.optimizer:.3f} s" in why
    # TP 8, on the device; the norms, which tensor parallelism leaves whole, on each GPU
    assert "DDP does not fit (needs 206.96 GB" in big.reasons["stage"]
    small = recommend(ModelSpec.from_arch(get_preset("llama2-7b")), config(RECIPES["bf16"]),
                      8, 80 * 10**9, cluster, 64, 2048)
    assert small.best.offload is None and small.reasons["offload"].startswith("none")
