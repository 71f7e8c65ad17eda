"""Faults: a rank that freezes must not hold the others past the process group's
timeout, and is named; ranks out of step fail at once, each position named (real gloo
ranks); a save folder that cannot take the run's checkpoints, or that another run
holds, stops the run before it starts."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import zeroshard as zs
from zeroshard.checkpoint import savedir
from zeroshard.cli import main
from zeroshard.plan import RECIPES
from zeroshard.runtime.spawn import RankFailure, spawn

from . import engine_cases as cases
from . import user_models as um


def _freeze_in_forward(stage: int):
    """Every group the engine creates inherits the default group's timeout (10 s here):
    rank 1 stops itself (SIGSTOP) before its forward; rank 0 waits for it in a gradient
    reduction, which travels on a group of the engine's own (a model without buffers:
    no broadcast on the default group comes first)."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=10))
    net = zs.shard(um.build("moe"), stage=stage)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    um.loss_of(net, "moe", um.batch("moe", 0)).backward()
    return "finished"


@pytest.mark.dist
@pytest.mark.slow  # the wait and its roll call are 20 s
@pytest.mark.parametrize("stage", [2])
def test_a_frozen_rank_ends_the_others_within_the_timeout(stage):
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        spawn(_freeze_in_forward, 2, stage, timeout=90)
    elapsed = time.monotonic() - start
    assert elapsed < 30, elapsed  # torch's default for a new group would be 30 minutes
    tb = failure.value.tracebacks[0]
    assert "CollectiveTimeout: rank 0 waited 10 s for " in tb, failure.value.tracebacks
    assert "silent: rank 1 (frozen, killed, or busy" in tb, tb
    assert "in the backward of step 1" in tb and "zeroshard train --timeout" in tb, tb


def _extra_micro_batch(stage: int):
    """Rank 1 runs one more forward and backward than rank 0 in step 2."""
    net = zs.shard(cases.build("mlp"), stage=stage)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for step in range(3):
        x, y = cases.batch("mlp", step)
        net(x, y).backward()
        if step == 1 and dist.get_rank() == 1:
            net(x, y).backward()
        opt.step()
        opt.zero_grad()
    return "finished"


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 3])
def test_ranks_out_of_step_fail_at_once_naming_both(stage):
    """Without the fingerprints the ranks would wait for each other in unlike
    collectives until the timeout (60 s here; 600 s before the fix, then a bare
    "Connection closed by peer")."""
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        spawn(_extra_micro_batch, 2, stage, timeout=60)
    assert time.monotonic() - start < 20
    for r in (0, 1):
        tb = failure.value.tracebacks[r]
        assert "RanksOutOfStep: ranks are out of step" in tb, tb
        # rank 0 at step 3's first reduction (stage 0: every rank holds the same
        # averaged gradients, so the step's non-finite verdict needs no exchange) or at
        # step 2's agreement; rank 1 in its extra backward's reduction or forward's gather
        assert ("rank 0: all_reduce of unit 3 (blocks.2) in the backward of step 3"
                if stage == 0 else "rank 0: an agreement at optimizer step 2 (collective #"
                ) in tb, tb
        assert ("rank 1: all_reduce of unit 3 (blocks.2) in the backward of step 2" if stage == 0
                else "rank 1: all_gather of unit 0 (MLP) in the forward of step 2") in tb, tb


def test_a_save_folder_that_cannot_be_written_stops_the_run_before_it_starts(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code = main(["train", "--steps", "2", "--save-dir", str(blocker / "ckpt")])
    err = capsys.readouterr().err
    assert code == 2 and "cannot be written" in err and "--save-dir=" in err


def test_a_full_save_folder_is_named_with_what_a_checkpoint_needs(tmp_path):
    with pytest.raises(ValueError, match=r"GB free; a checkpoint beside the last one needs"):
        savedir.check(tmp_path, 10**18)
    assert savedir.checkpoint_bytes(1000, RECIPES["bf16-mixed-adamw"]) == 12_000  # 4 + 8
    assert savedir.checkpoint_bytes(1000, RECIPES["fp32-adamw"]) == 12_000  # 4 + 4 + 4


def test_two_runs_on_one_save_folder(tmp_path, capsys):
    """While a live run holds the folder a second is refused by name; a lock left by a
    run that died is taken over; the lock goes with its run."""
    with savedir.hold(tmp_path):
        code = main(["train", "--steps", "2", "--save-dir", str(tmp_path)])
        err = capsys.readouterr().err
        assert code == 2 and f"pid {os.getpid()}" in err and "is held by another run" in err
    assert not (tmp_path / savedir.LOCK).exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (tmp_path / savedir.LOCK).write_text(json.dumps(
        {"host": socket.gethostname(), "pid": int(dead), "started": "earlier"}))
    with savedir.hold(tmp_path):
        assert json.loads((tmp_path / savedir.LOCK).read_text())["pid"] == os.getpid()


@pytest.mark.dist
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc")
@pytest.mark.parametrize("launch", [["-m", "zeroshard.train.launch", "--nproc-per-node", "2"],
                                    []], ids=["zeroshard-train-launcher", "init-distributed"])
def test_the_store_and_ranks_listen_on_loopback_only(launch):
    """``zeroshard train``'s launcher (torchrun's own would listen on every interface:
    "[::]") and ``zs.init_distributed`` on one machine."""
    script = os.path.join(os.path.dirname(__file__), "listeners.py")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT",
                                                              "GLOO_SOCKET_IFNAME")}
    done = subprocess.run([sys.executable, *launch, script], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    addresses = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(addresses) >= (3 if launch else 1), addresses  # the store, and gloo's pairs
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses


def _save_fails_on_one_rank(folder: str):
    """Rank 1's disk fills during the second save; rank 0's write succeeds."""
    import errno
    from pathlib import Path

    from zeroshard.checkpoint import sharded

    net = zs.shard(cases.build("mlp"), stage=2)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net(*cases.batch("mlp", 0)).backward()
    opt.step()
    zs.save(net, opt, Path(folder) / "step-1")
    if dist.get_rank() == 1:
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device", args[0])
        sharded.write_tensors = full
    try:
        zs.save(net, opt, Path(folder) / "step-2")
        return "saved"
    except sharded.SaveFailed as exc:
        return str(exc)


@pytest.mark.dist
def test_a_save_that_fails_on_one_rank_fails_on_every_rank(tmp_path):
    """No rank waits for the timeout; the unfinished copy goes; latest keeps the last
    complete checkpoint, which loads."""
    from zeroshard.checkpoint.sharded import resolve

    start = time.monotonic()
    msgs = spawn(_save_fails_on_one_rank, 2, str(tmp_path), timeout=120)
    assert time.monotonic() - start < 60
    assert msgs[0] == msgs[1] and "checkpoint not saved: rank 1: " in msgs[0], msgs
    assert "No space left on device" in msgs[0], msgs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"]
    assert resolve(tmp_path).name == "step-1"


def _final_save_blocked(folder: str):
    from zeroshard.checkpoint import sharded
    from zeroshard.checkpoint.sharded import SaveFailed
    from zeroshard.train.loop import train
    from zeroshard.train.settings import TrainConfig

    write = sharded.write_tensors

    def full_at_the_end(path, *args, **kwargs):  # the disk fills before the last save
        if "step-000004" in path:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return write(path, *args, **kwargs)

    sharded.write_tensors = full_at_the_end
    try:
        train(TrainConfig(model="tiny", steps=4, batch=4, eval_every=100, eval_batches=1,
                          sample_chars=0, save_dir=folder, save_every=2))
    except SaveFailed as exc:
        return str(exc)
    return "finished"


@pytest.mark.dist
def test_a_final_save_that_fails_twice_states_what_is_lost(tmp_path, capfd):
    """The disk fills before the last checkpoint: its save fails, is tried once more,
    and the error names the last complete checkpoint and the steps no checkpoint
    holds."""
    msgs = spawn(_final_save_blocked, 2, str(tmp_path), timeout=120)
    assert msgs[0] == msgs[1], msgs
    assert "checkpoint not saved: " in msgs[0] and ", twice. Trained through step 4; the " \
        f"last complete checkpoint is {tmp_path / 'step-000002'} (step 2): steps 3-4 are " \
        "not saved" in msgs[0], msgs
    assert "step 4: checkpoint not saved:" in capfd.readouterr().out  # the retry, announced
