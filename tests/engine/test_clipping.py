"""Gradient clipping on real gloo processes at N = 2: the global norm (2 and inf) equals
torch's clip_grad_norm_ on DDP at every stage, and training that clips on every step
keeps stages 0-3 bit-for-bit equal and within 1e-6 of DDP."""

import pytest

from zeroshard.runtime.spawn import spawn

from . import engine_cases as cases

pytestmark = pytest.mark.dist


def _grid():
    return {"parity": cases.parity_grid(["mlp", "gpt"], ["clip"], steps=10),
            "norms": cases.clip_norms("gpt")}


@pytest.fixture(scope="module")
def grid():
    return spawn(_grid, 2, timeout=600)[0]


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_fp32_parity_with_clipping_n2(grid, model):
    r = grid["parity"][(model, "clip")]
    assert max(r["diff_to_ddp"]) < cases.TOL, r["diff_to_ddp"]
    assert all(r["bit_equal_to_stage0"]), r


def test_clip_norm_matches_torch(grid):
    """Also torch's own ``clip_grad_norm_``, bound before the first ``zs.shard`` (``from
    torch.nn.utils import clip_grad_norm_``), clips the shards by the global norm: the
    same norm and gradients as ``model.clip_grad_norm_``, bit for bit ([Note: torch's
    clip_grad_norm_ on shards])."""
    for stage, (ours, torch_norm, inf, torch_inf, early, gap) in enumerate(grid["norms"]):
        assert abs(ours - torch_norm) <= 1e-6 * torch_norm, (stage, ours, torch_norm)
        assert inf == torch_inf, (stage, inf, torch_inf)
        assert early == ours and gap == 0.0, (stage, early, ours, gap)
    assert len({n[0] for n in grid["norms"]}) == 1  # every stage: the same norm, bit for bit


def test_torch_keeps_its_own_clip_function():
    """zeroshard replaces no public function of torch: ``torch.nn.utils.clip_grad_norm_``
    is torch's own object after a model is sharded (a group of one in a fresh process)."""
    import subprocess
    import sys

    code = ("import torch, torch.distributed as dist, zeroshard as zs\n"
            "from torch.nn.utils import clip_grad, clip_grad_norm_\n"
            "before = (clip_grad_norm_, torch.nn.utils.get_total_norm)\n"
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
            "zs.shard(torch.nn.Linear(4, 4), stage=3)\n"
            "assert torch.nn.utils.clip_grad_norm_ is before[0] is clip_grad.clip_grad_norm_\n"
            "assert torch.nn.utils.get_total_norm is before[1]\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
