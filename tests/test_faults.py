"""Faults on real gloo ranks: a rank that freezes must not hold the others past the
process group's timeout."""

import os
import signal
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import zeroshard as zs
from zeroshard.runtime.spawn import RankFailure, spawn

from . import user_models as um

pytestmark = pytest.mark.dist


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


@pytest.mark.parametrize("stage", [0, 2])
def test_a_frozen_rank_ends_the_others_within_the_timeout(stage):
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        spawn(_freeze_in_forward, 2, stage, timeout=90)
    elapsed = time.monotonic() - start
    assert elapsed < 30, elapsed  # torch's default for a new group would be 30 minutes
    assert "rank 0" in str(failure.value) and "imed out" in failure.value.tracebacks[0], (
        failure.value.tracebacks)
