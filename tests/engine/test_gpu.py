"""GPU tier: the engine and the trainer on CUDA over NCCL, one rank per GPU (up to 2).

Skipped where CUDA is absent. NCCL picks its own reduction order, so stages are held to
a tolerance here, not to the bit-for-bit equality the gloo tier asserts."""

import pytest
import torch

from zeroshard.runtime.spawn import spawn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _stages(precision):
    """Five AdamW steps of the tiny GPT at each stage: full weights, losses and the
    CUDA allocator's peak."""
    import torch.distributed as dist

    import zeroshard as zs
    from zeroshard.data import Corpus
    from zeroshard.models.gpt import GPT, get_preset

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, corpus = get_preset("tiny"), Corpus.builtin()
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    out = {}
    for stage in range(4):
        torch.manual_seed(0)
        torch.cuda.reset_peak_memory_stats()
        net = zs.shard(GPT(cfg), stage=stage, mixed_precision=precision)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        assert all(p.is_cuda for p in net.parameters())
        losses = []
        for step in range(5):
            x, y = corpus.batch("train", 0, step, 8, cfg.block_size)
            loss = net(x[rows].cuda(), y[rows].cuda())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        weights = {k: v.float().cpu() for k, v in net.full_state_dict().items()}
        out[stage] = {"losses": losses, "weights": weights,
                      "peak": torch.cuda.max_memory_allocated()}
        del net, opt
        torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_stages_agree_on_cuda(precision):
    world = min(2, torch.cuda.device_count())
    r = spawn(_stages, world, precision, backend="nccl", timeout=600)[0]
    tol = 1e-5 if precision is None else 2e-2
    for stage in (1, 2, 3):
        for name, w in r[stage]["weights"].items():
            assert torch.allclose(w, r[0]["weights"][name], atol=tol, rtol=0), (stage, name)
        assert abs(r[stage]["losses"][-1] - r[0]["losses"][-1]) < tol
    assert r[0]["losses"][-1] < r[0]["losses"][0]
    if world > 1:  # sharding must show in the allocator's peak, not only in the ledger
        assert r[3]["peak"] < r[0]["peak"]


def _trainer():
    from zeroshard.spec.config import ZeroConfig
    from zeroshard.train.loop import train
    from zeroshard.train.settings import TrainConfig

    return train(TrainConfig(model="tiny", zero=ZeroConfig(stage=3), steps=4, batch=8,
                             eval_every=2, eval_batches=1, sample_chars=8))


def test_trainer_runs_on_cuda():
    world = min(2, torch.cuda.device_count())
    r = spawn(_trainer, world, backend="nccl", timeout=600)[0]
    assert len(r["losses"]) == 4 and r["losses"][-1] < r["first_val"]
