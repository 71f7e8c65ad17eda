"""Disk offload (``offload_dir``) on real gloo ranks (N = 2), in one spawn: 20 AdamW steps
(clipped, an LR schedule) bit for bit equal to the same run without offload at stages
1-3 in fp32 and bf16; checkpoints across offload modes and stages; the step's host
memory bounded by its sub-group buffers; the scratch files gone with the model; every
bad input one line."""

import ctypes
import gc
import os
import shutil
import subprocess

import pytest
import torch
from torch.distributed.tensor import DTensor

import zeroshard as zs
from zeroshard.offload import HostAdamW
from zeroshard.runtime.spawn import spawn

from . import engine_cases as cases


def _rows(state: dict) -> dict:
    """A copy of one parameter's optimizer state: this rank's rows (a DTensor's local
    tensor, as the optimizer's state dict gives them)."""
    return {n: (t.to_local() if isinstance(t, DTensor) else t).clone() for n, t in state.items()}

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # host offload: test_offload.py
SUB = 1000  # elements per sub-group: the GPT case's rank holds 10 512, so 11 sub-groups


def _optimizer(net, optim="fused"):
    params = list(net.parameters())
    opt = (HostAdamW(params, lr=1e-3, weight_decay=0.1) if optim == "host" else
           torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s))


def _train(net, opt, sched, steps, start=0):
    for step in range(start, start + steps):
        net(*cases.batch("gpt", step)).backward()
        net.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()


def _net(stage, precision, root, offload="optimizer"):
    disk = dict(offload=offload, offload_dir=root, sub_group_size=SUB) if root else {}
    return zs.shard(cases.build("gpt"), stage=stage, mixed_precision=precision, **disk)


def _rss() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                if k in ("VmRSS", "VmHWM")}


def _step_growth(offload_dir, sub):
    """Peak RSS growth over the first optimizer step (bytes), the state's bytes and the
    buffers', for a 1.05 M-parameter MLP at stage 3, bf16."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    kw = dict(offload_dir=offload_dir, sub_group_size=sub) if offload_dir else {}
    net = zs.shard(mlp, stage=3, mixed_precision="bf16", offload="optimizer", units="blocks",
                   **kw)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
    net(torch.randn(8, 512)).square().mean().backward()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the heap's free pages back: RSS is what is used
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS
        f.write("5")
    before = _rss()["VmRSS"]
    opt.step()
    grown = _rss()["VmHWM"] - before
    streamed = net.stepper.disk_step.buffer_bytes() if offload_dir else 0
    state = 12 * sum(s.numel() for s in net.parameters())
    del net, opt
    gc.collect()
    return grown, state, streamed


def _grid(root, full):
    rank = torch.distributed.get_rank()
    out = {}
    for precision in (None, "bf16"):
        for stage in (1, 2, 3):
            for disk in (None, root):
                net = _net(stage, precision, disk)
                opt, sched = _optimizer(net)
                _train(net, opt, sched, 20)
                out[(precision, stage, disk is not None)] = net.full_state_dict()
                if (precision, stage) == ("bf16", 3):
                    name = "disk" if disk else "plain"
                    out[("state", name)] = {k: _rows(v)
                                            for k, v in opt.state_dict()["state"].items()}
                    out[("placed", name)] = net.memory(opt, by_placement=True)
                    zs.save(net, opt, os.path.join(root, f"ckpt-{name}"))
                    _train(net, opt, sched, 1, start=20)
                    out[("step 21", name)] = net.full_state_dict()
                del net, opt, sched
    net = _net(3, "bf16", root, offload="params")  # weight shards on the host too
    opt, sched = _optimizer(net)
    _train(net, opt, sched, 20)
    out["params"] = net.full_state_dict()
    del net, opt, sched
    # checkpoints across offload modes and stages: each resumes to the same step 21
    for name, stage, disk in (("plain", 1, root), ("disk", 2, None)):
        net = _net(stage, "bf16", disk)
        opt, sched = _optimizer(net)
        zs.load(net, opt, os.path.join(root, f"ckpt-{name}"))
        for _ in range(20):
            sched.step()
        out[("loaded", name)] = {k: _rows(v)
                                 for k, v in opt.state_dict()["state"].items()}
        _train(net, opt, sched, 1, start=20)
        out[("resumed", name)] = net.full_state_dict()
        del net, opt, sched
    # across N: a shard group of one holds every row (the checkpoint's 2 files in 1)
    net = zs.shard(cases.build("gpt"), stage=3, mixed_precision="bf16", offload="optimizer",
                   offload_dir=root, sub_group_size=SUB, shard_group=1)
    opt, sched = _optimizer(net)
    zs.load(net, opt, os.path.join(root, "ckpt-disk"))
    out["K=1"] = (net.full_state_dict(), {k: _rows(v)
                                          for k, v in opt.state_dict()["state"].items()})
    del net, opt, sched
    net = _net(3, "bf16", root)  # HostAdamW drives the streamed step alike
    opt, sched = _optimizer(net, "host")
    _train(net, opt, sched, 20)
    out["host"] = net.full_state_dict()
    out["refused"] = []
    for bad in (lambda p: torch.optim.SGD(p, lr=0.1),
                lambda p: torch.optim.AdamW(p, amsgrad=True)):
        opt = bad(net.parameters())
        net(*cases.batch("gpt", 0)).backward()
        try:
            opt.step()
        except ValueError as exc:
            out["refused"].append(str(exc))
        net.zero_grad()
    del net, opt, sched
    # a disk that fills during a step: every write of the files meets ENOSPC
    net = _net(3, "bf16", root)
    opt, sched = _optimizer(net)
    _train(net, opt, sched, 1)
    zs.save(net, opt, os.path.join(root, "ckpt-before"))
    out["before"] = net.full_state_dict()
    full_fds = []
    for u in net.units:
        if u.disk is not None:
            full_fds.append(os.open("/dev/full", os.O_RDWR))  # reads zeros, writes ENOSPC
            u.disk.fd = full_fds[-1]
    try:
        _train(net, opt, sched, 1, start=1)
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        out["filled"] = f"{type(exc).__name__}: {exc}"
    try:  # the files went with the failure: a step again is refused, not run on stale fds
        _train(net, opt, sched, 1, start=2)
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        out["again"] = f"{type(exc).__name__}: {exc}"
    for fd in full_fds:
        os.close(fd)
    del net, opt, sched
    plain = _net(3, "bf16", None)
    zs.load(plain, _optimizer(plain)[0], os.path.join(root, "ckpt-before"))
    out["after"] = plain.full_state_dict()
    del plain
    out["growth"] = {"disk": _step_growth(root, 32768), "host": _step_growth(None, 0)}
    if full is not None:
        try:
            _net(3, "bf16", full)
        except Exception as exc:  # noqa: BLE001 - the message is what is tested
            out["full"] = f"{type(exc).__name__}: {exc}"
    gc.collect()
    out["left"] = [f for f in os.listdir(root) if f.startswith(f"zeroshard-offload-rank{rank}")]
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk")
    full = tmp_path_factory.mktemp("full")  # a 64 KiB file system: smaller than
    # the two ranks' state, large enough for one rank's once the other's files are gone
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)],
                             capture_output=True).returncode == 0
    try:
        yield spawn(_grid, 2, str(root), str(full) if mounted else None, timeout=600)
    finally:
        if mounted:
            subprocess.run(["umount", str(full)], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("precision", [None, "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_disk_offload_is_exact(ranks, precision, stage):
    for r in ranks:
        assert cases.bit_equal(r[(precision, stage, True)], r[(precision, stage, False)])


def test_with_the_weight_shards_on_the_host(ranks):
    for r in ranks:
        assert cases.bit_equal(r["params"], r[("bf16", 3, False)])


def test_state_dict_reads_the_files(ranks):
    for r in ranks:
        disk, plain = r[("state", "disk")], r[("state", "plain")]
        assert disk.keys() == plain.keys() and len(disk) > 0
        for k in disk:
            assert disk[k].keys() == plain[k].keys() == {"step", "exp_avg", "exp_avg_sq"}
            for n in disk[k]:
                assert torch.equal(disk[k][n], plain[k][n]), (k, n)


def test_checkpoints_resume_across_offload_modes_and_stages(ranks):
    for r in ranks:
        for name in ("plain", "disk"):
            loaded = r[("loaded", name)]
            assert {k: {n: t.shape for n, t in v.items()} for k, v in loaded.items()} == {
                k: {n: t.shape for n, t in v.items()} for k, v in r[("state", name)].items()}
            assert cases.bit_equal(r[("resumed", name)], r[("step 21", "plain")])
        assert cases.bit_equal(r[("step 21", "disk")], r[("step 21", "plain")])


def test_a_checkpoint_loads_at_another_shard_count(ranks):
    """Saved by 2 ranks, loaded where one rank holds every row (``shard_group=1``)."""
    for r in ranks:
        weights, state = r["K=1"]
        assert cases.bit_equal(weights, r[("bf16", 3, True)])
        halves = [x[("state", "disk")] for x in ranks]
        for k in state:
            for n in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[k][n], torch.cat([h[k][n] for h in halves]))


def test_host_adamw_drives_the_streamed_step(ranks):
    for r in ranks:
        assert cases.bit_equal(r["host"], r[("bf16", 3, False)])


def test_memory_by_placement(ranks):
    """After the step: master and both moments on disk (12 bytes an owned element), the
    host holding the two sub-group buffers, the device what it holds offloaded."""
    for r in ranks:
        disk, plain = r[("placed", "disk")], r[("placed", "plain")]
        owned = plain["device"]["optimizer"] // 12  # bf16 AdamW: 12 bytes, on the device
        assert disk["disk"]["optimizer"] == 12 * owned and disk["device"]["optimizer"] == 0
        assert disk["host"]["optimizer"] == 0 and disk["host"]["params"] == 0
        assert disk["host"]["buffers"] == 2 * 12 * SUB  # after the step: the sub-groups
        assert disk["device"]["params"] == plain["device"]["params"]
        assert plain["disk"] == dict.fromkeys(plain["disk"], 0)


def test_the_steps_host_memory_is_the_sub_group_buffers(ranks):
    """The first step's peak RSS growth is the two sub-group buffers it makes (0.8 MB)
    plus under 1 MB, under a third of the 6.3 MB of state on disk;
    host offload's first step grows by the moments it allocates (measured 4.7 MB), so
    a step that held the state would fail the bound."""
    for r in ranks:
        grown, state, streamed = r["growth"]["disk"]
        assert streamed == 2 * 12 * 32768
        assert grown <= streamed + 2**20 and grown < state / 3, r["growth"]
        host_grown = r["growth"]["host"][0]
        assert host_grown > 0.9 * state * 8 / 12, r["growth"]  # its m and v


def test_scratch_files_go_with_the_model(ranks):
    for r in ranks:
        assert r["left"] == []


def test_refused_optimizers_are_one_line(ranks):
    sgd, amsgrad = ranks[0]["refused"]
    assert sgd == ("offload_dir: the optimizer state on disk is stepped by a streamed AdamW "
                   "(torch's fused kernel), which cannot reproduce SGD; use torch.optim.AdamW "
                   "or zeroshard.offload.HostAdamW")
    assert amsgrad == ("offload_dir: AdamW param group 0 has amsgrad=True, which the streamed "
                       "AdamW step does not do; accepted: amsgrad=False")


def test_a_full_disk_is_one_line(ranks):
    if "full" not in ranks[0]:
        pytest.skip("mounting a 64 KiB tmpfs was not permitted")
    first = ranks[0]["full"]
    assert first.startswith("OffloadDiskError: rank ") and ": offload_dir '" in first
    assert "is full: writing" in first and "(No space left on device)" in first
    assert "\n" not in first
    assert ranks[1]["full"] == first  # every rank stops, with the same line


def test_a_disk_full_in_a_step_stops_the_run(ranks):
    """Writes meeting ENOSPC in the step (the files' descriptors pointed at /dev/full)
    stop it with one line on every rank; the checkpoint saved before loads unchanged."""
    for r in ranks:
        assert r["filled"].startswith("OffloadDiskError: offload_dir '")
        assert ("is full: writing optimizer state to" in r["filled"]
                and "(No space left on device)" in r["filled"] and "\n" not in r["filled"])
        assert cases.bit_equal(r["after"], r["before"])
        assert r["again"].startswith("OffloadDiskError: offload_dir: ") and \
            "was removed after a step failed on it" in r["again"], r["again"]


@pytest.mark.parametrize("options,message", [
    ({"offload_dir": "/nonexistent/zs"}, "offload_dir='/nonexistent/zs' keeps the offloaded "
                                          "optimizer state on disk, but offload=None"),
    ({"offload": "optimizer", "offload_dir": "/nonexistent/zs"},
     "offload_dir='/nonexistent/zs' does not exist; expected an existing writable directory"),
    ({"offload": "optimizer", "offload_dir": "/proc/self/status"},
     "offload_dir='/proc/self/status' is not a directory"),
    ({"offload": "optimizer", "offload_dir": "/proc"}, "offload_dir='/proc' is not writable ("),
    ({"sub_group_size": 0}, "sub_group_size=0 must be an integer >= 1"),
    ({"sub_group_size": True}, "sub_group_size=True must be an integer >= 1"),
    ({"stage": 0, "offload": "optimizer", "offload_dir": "/tmp"}, "stage 0 shards nothing"),
])
def test_bad_disk_options_are_one_line(options, message):
    with pytest.raises(ValueError) as exc:
        zs.ZeroConfig(**options)
    assert str(exc.value).startswith(message) or message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_deepspeed_nvme_translates(tmp_path):
    cfg = zs.ZeroConfig.from_dict({"zero_optimization": {
        "stage": 3, "sub_group_size": 1e7,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}})
    assert (cfg.offload, cfg.offload_dir, cfg.sub_group_size) == ("optimizer", str(tmp_path),
                                                                   10_000_000)
    cpu = zs.ZeroConfig.from_dict({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}})
    assert (cpu.offload, cpu.offload_dir) == ("params", None)
    for zero, message in (
            ({"offload_optimizer": {"device": "nvme"}}, "zero_optimization.offload_optimizer."
                                                        "device='nvme' needs nvme_path"),
            ({"offload_param": {"device": "nvme", "nvme_path": "/tmp"}},
             "zero_optimization.offload_param.device='nvme'; expected 'none' or 'cpu'"),
            ({"offload_optimizer": {"device": "nvme", "nvme_path": "/nonexistent/zs"}},
             "zero_optimization.offload_optimizer.nvme_path='/nonexistent/zs' does not exist")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            zs.ZeroConfig.from_dict({"zero_optimization": {"stage": 2, **zero}})
