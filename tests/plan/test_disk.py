"""Disk offload in the planner's peak, step time and recommendation (``--offload-dir``).

The placement itself (device, host and disk bytes against the engine's ledger) is
``tests/plan/test_offload.py``'s; here the figures built on it: the peak's host bytes
and a node's host memory follow ``placed_bytes`` on disk while the
device's moments stay host offload's, and the step pays the streamed step's disk I/O
(``offload.streamed_step``), worked by hand on a toy case.
"""

import json

import pytest

from zeroshard.plan import (
    PLANNED_DISK,
    ModelSpec,
    ParallelDims,
    Schedule,
    Workload,
    ZeroConfig,
    get_preset,
    get_recipe,
)
from zeroshard.plan.hardware import (
    HOSTS,
    Cluster,
    Host,
    Link,
    get_accelerator,
    get_host,
    get_network,
)
from zeroshard.plan.memory import plan_all
from zeroshard.plan.peak import peak
from zeroshard.plan.placement import placed_bytes, streamed_step
from zeroshard.plan.recommend import recommend
from zeroshard.plan.steptime import step_time

BF16, FP32 = get_recipe("bf16-mixed-adamw"), get_recipe("fp32-adamw")
LLAMA7 = ModelSpec.from_arch(get_preset("llama2-7b"))
ON8 = ParallelDims(8)


def config(recipe, stage=3, **options) -> ZeroConfig:
    """The planner's configuration: ``recipe`` taken whole (reduced in its own dtype)."""
    return ZeroConfig(stage=stage, mixed_precision=recipe, **options)


def on_disk(recipe, stage=3, **options) -> ZeroConfig:
    """Offloaded to disk as ``--offload-dir`` plans it: no folder (``PLANNED_DISK``)."""
    return config(recipe, stage, offload="optimizer", offload_dir=PLANNED_DISK, **options)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("recipe", [BF16, FP32], ids=lambda r: r.name)
def test_peak_host_is_the_disk_placement_device_unchanged(stage, recipe):
    """Under disk the host holds the fp32 gradient copy and two sub-groups (no AdamW
    temporaries: the streamed step runs the fused kernel), and nothing on the device
    moves: every moment of the step is host offload's."""
    work, sub = Workload(2048), 50_000_000
    disk = peak(LLAMA7, ON8, on_disk(recipe, stage, sub_group_size=sub), work)
    host = peak(LLAMA7, ON8, config(recipe, stage, offload="optimizer"), work)
    placed = placed_bytes(LLAMA7.params, ON8, on_disk(recipe, stage, sub_group_size=sub))
    n = -(-LLAMA7.params // 8)
    assert disk.host == placed.host.total == 4 * n + 2 * 12 * sub
    assert disk.phases == host.phases and disk.bytes == host.bytes
    assert host.host > disk.host + 12 * n  # the master and the moments left for the files
    plans = plan_all(LLAMA7, ON8, on_disk(recipe, sub_group_size=sub), work)
    plain = plan_all(LLAMA7, ON8, config(recipe, offload="optimizer"), work)
    assert plans[stage].host == disk.host and plans[stage].total == plain[stage].total
    assert plans[stage].placement.host_per_node(8) == 8 * disk.host
    assert plans[stage].placement.disk.total == 12 * n


def test_disk_needs_an_offload_in_every_entry_point(tmp_path):
    """Every entry point takes a ``ZeroConfig``, which refuses a disk without an offload
    (a planned one or a real folder alike) and a bad sub-group size, in the engine's
    words; the planned disk is priced as a real folder is, and runs nowhere."""
    import os

    msg = "offload_dir=PLANNED_DISK keeps the offloaded optimizer state on disk"
    with pytest.raises(ValueError, match=msg):
        config(BF16, offload_dir=PLANNED_DISK)
    with pytest.raises(ValueError, match=f"offload_dir='{tmp_path}' keeps the offloaded"):
        config(BF16, offload_dir=str(tmp_path))
    with pytest.raises(ValueError, match="sub_group_size=0 must be an integer >= 1"):
        on_disk(BF16, sub_group_size=0)
    real = config(BF16, offload="optimizer", offload_dir=str(tmp_path))
    assert [p.as_dict() for p in plan_all(LLAMA7, ON8, real)] == [
        p.as_dict() for p in plan_all(LLAMA7, ON8, on_disk(BF16))]
    assert peak(LLAMA7, ON8, real, Workload()) == peak(LLAMA7, ON8, on_disk(BF16), Workload())
    with pytest.raises(ValueError, match="offload_dir=PLANNED_DISK plans disk offload "
                                         "without a folder"):
        os.fspath(on_disk(BF16).offload_dir)  # the engine makes its files through this


def test_streamed_step_by_hand():
    """n = 10 in sub-groups of 4: 4, 4, 2. Host-bound (h = 1, d = 0.3 a element each
    way): the first read 1.2, the slots max(4, 0.3·4) + max(4, 0.3·(2 + 4)) + max(2,
    0.3·4), the last write 0.6. Disk-bound (h = 0.1, d = 1): 4 + 4 + 6 + 4 + 2 = 2·d·n."""
    assert streamed_step(10, 4, 1.0, 0.3) == pytest.approx(1.2 + 4 + 4 + 2 + 0.6)
    assert streamed_step(10, 4, 0.1, 1.0) == pytest.approx(20.0)
    assert streamed_step(10, 100, 1.0, 0.3) == pytest.approx(3 + 10 + 3)  # one sub-group
    # 10,000 whole sub-groups and one of 1: every whole one host-bound (1000 against
    # 0.25·2000 at most), the last waits for the write of the one before (0.25·1000)
    assert streamed_step(10_000_001, 1000, 1.0, 0.25) == pytest.approx(
        250 + 10_000 * 1000 + 250 + 0.25)


def test_step_time_adds_the_drive_by_hand():
    """A bare 8 M-parameter count on 2 GPUs at stage 3 owns n = 4 M elements, stepped in
    sub-groups of 1.5 M (1.5, 1.5, 1 M). fp32 AdamW: 28 host bytes an element at 28 GB/s
    per GPU (56 GB/s for a node of 2) is h = 1 ns; 12 bytes each way at 12 GB/s is d = 1
    ns. The streamed step, in ms: first read 1.5, slots max(1.5, 1.5) + max(1.5, 2.5) +
    max(1, 1.5), last write 1 = 8 ms against the host step's 4: 4 ms more. The drive
    reads and writes 2·12·n bytes: 8 ms."""
    model = ModelSpec("toy", 8_000_000, 512, 4, 8)
    host = Host("toy", Link("toy link", 10e9, 0.0), 56e9, 12e9)
    cluster = Cluster(get_accelerator("h100"), get_network("loopback"), 2, host)
    work, on2 = Workload(512), ParallelDims(2)
    base = config(FP32, offload="optimizer")
    disk = on_disk(FP32, sub_group_size=1_500_000)
    plain, streamed = (step_time(model, on2, c, work, cluster, Schedule()) for c in (base, disk))
    assert plain.optimizer == streamed.optimizer == pytest.approx(4e-3)
    assert streamed.disk == pytest.approx(8e-3) and plain.disk == 0
    assert streamed.disk_wait == pytest.approx(4e-3)
    assert streamed.step == pytest.approx(plain.step + 4e-3)  # nothing overlaps on loopback
    assert streamed.exposed == pytest.approx(plain.exposed)
    # a drive faster than the host step hides behind it but for the two ends' 1.5 + 1 ms
    quick = Cluster(cluster.accelerator, cluster.network, 2, Host("q", host.pcie, 56e9, 120e9))
    fast = step_time(model, on2, disk, work, quick)
    assert fast.disk_wait == pytest.approx(0.15e-3 + 0.1e-3)


def test_host_presets_carry_the_drive():
    assert [h.disk_bandwidth for h in HOSTS.values()] == [5e9, 5e9]
    h = get_host("pcie4", disk_bandwidth=7e9)
    assert (h.disk_bandwidth, h.memory_bandwidth) == (7e9, 300e9)
    with pytest.raises(ValueError, match="disk_bandwidth=0 must be a positive number"):
        Host("x", h.pcie, 1e9, 0)


def _main(capsys, *argv):
    from zeroshard.cli import main

    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("argv, line", [
    (["--offload-dir"], "--offload-dir keeps the offloaded optimizer state on disk: add "
     "--offload optimizer (or params), or --recommend (which offloads only when nothing "
     "fits)"),
    (["--sub-group-size", "1000"], "--sub-group-size=1000 sizes disk offload's step: add "
     "--offload-dir"),
    (["--offload", "optimizer", "--offload-dir", "--sub-group-size", "0"],
     "--sub-group-size=0 must be positive"),
    (["--disk-bandwidth", "3"], "--disk-bandwidth=3.0 prices disk offload: add --offload-dir"),
])
def test_cli_bad_disk_flags_are_one_line(capsys, argv, line):
    rc, out, err = _main(capsys, "--params", "1000", "--gpus", "2", *argv)
    assert rc != 0 and out == ""
    assert err.strip().splitlines() == [f"zeroshard plan: error: {line}"]


def test_cli_time_json_has_the_disk_seconds(capsys):
    rc, out, _ = _main(capsys, "--model", "llama2-7b", "--gpus", "8", "--offload",
                       "optimizer", "--offload-dir", "--disk-bandwidth", "2.5", "--time",
                       "--json")
    z3 = json.loads(out)["time"][3]
    n = -(-LLAMA7.params // 8)
    assert rc == 0 and z3["disk"] == pytest.approx(2 * 12 * n / 2.5e9)
    assert 0 < z3["disk_wait"] < z3["disk"]


def test_recommend_on_disk_says_the_disk_seconds():
    """The same device peaks fit with the state on disk, so the same configuration wins
    on the device; the offload reason names the drive's seconds."""
    model = ModelSpec.from_arch(get_preset("llama2-70b"))
    cluster = Cluster(get_accelerator("h100"), get_network("nvlink4-ndr"))
    rec = recommend(model, config(BF16), 8, 80 * 10**9, cluster, 64, 2048, tp=1, prefetch=1,
                    offload_dir=PLANNED_DISK)
    b = rec.best
    assert (b.offload, b.offload_dir, b.stage) == ("optimizer", True, 3)
    n = -(-model.params // 8)
    assert b.time.disk == pytest.approx(2 * 12 * n / 5e9)
    why = rec.reasons["offload"]
    assert f"{b.time.disk:.3f} s of disk I/O at 5 GB/s, {b.time.disk_wait:.3f} s" in why
    assert "103.46 GB per GPU read and written each step" in why
