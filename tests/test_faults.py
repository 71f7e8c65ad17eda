"""Faults: a rank that freezes must not hold the others past the process group's
timeout (real gloo ranks); a save folder that cannot take the run's checkpoints, or that
another run holds, stops the run before it starts."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import zeroshard as zs
from zeroshard.checkpoint import savedir
from zeroshard.cli import main
from zeroshard.plan import RECIPES
from zeroshard.runtime.spawn import RankFailure, spawn

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
@pytest.mark.parametrize("stage", [0, 2])
def test_a_frozen_rank_ends_the_others_within_the_timeout(stage):
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        spawn(_freeze_in_forward, 2, stage, timeout=90)
    elapsed = time.monotonic() - start
    assert elapsed < 30, elapsed  # torch's default for a new group would be 30 minutes
    assert "rank 0" in str(failure.value) and "imed out" in failure.value.tracebacks[0], (
        failure.value.tracebacks)


def test_a_save_folder_that_cannot_be_written_stops_the_run_before_it_starts(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code = main(["train", "--steps", "2", "--save-dir", str(blocker / "ckpt")])
    err = capsys.readouterr().err
    assert code == 2 and "cannot be written" in err and "save_dir=" in err


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
