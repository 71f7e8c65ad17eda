"""The multi-process harness: real gloo ranks, tracebacks from failing ranks, no hangs."""

import threading

import pytest
import torch
import torch.distributed as dist

from zeroshard.runtime.spawn import RankFailure, spawn

pytestmark = pytest.mark.dist


def _grid(cases):
    """One spawn runs a grid of cases: all-reduce of rank-dependent tensors."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for n in cases:
        t = torch.full((n,), float(rank + 1))
        dist.all_reduce(t)
        out[n] = t.tolist()
    return rank, world, out


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()  # rank 0 would block here forever without the harness
    return "unreachable"


def _hang():
    if dist.get_rank() == 1:
        threading.Event().wait()  # never set: rank 1 hangs, rank 0 waits on it in barrier
    dist.barrier()


def test_grid_of_cases_on_three_ranks():
    results = spawn(_grid, 3, [1, 5])
    assert [r[:2] for r in results] == [(0, 3), (1, 3), (2, 3)]
    for _, _, out in results:
        assert out == {1: [6.0], 5: [6.0] * 5}


def test_failure_reports_the_rank_traceback():
    with pytest.raises(RankFailure) as exc:
        spawn(_fail_on_rank_1, 2, timeout=60)
    assert 1 in exc.value.tracebacks
    assert "ValueError: rank 1 refuses" in str(exc.value)


def test_timeout_instead_of_hang():
    with pytest.raises(RankFailure, match="did not finish within"):
        spawn(_hang, 2, timeout=4)
