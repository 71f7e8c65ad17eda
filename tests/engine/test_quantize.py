"""Block-quantized collectives (``runtime/quantize.py``): the int8 + fp32-scale format's
error bound, exact cases, zero and short blocks, non-finite propagation and determinism;
then on 4 real gloo ranks (the world and two sub-groups of 2) the quantized all-gather
and reduce-scatter against their oracles bit for bit, within the stated bound of the
exact collective, with the bytes they send."""

import math

import pytest
import torch
import torch.distributed as dist

from zeroshard.runtime.quantize import (
    QUANT_BLOCK,
    _dequantize_rows,
    _quantize_rows,
    dequantize,
    quantize,
    quantized_all_gather,
    quantized_nbytes,
    quantized_reduce_scatter,
    quantized_ring_bytes,
)
from zeroshard.runtime.spawn import spawn

#: fp32 rounding of x/s and q·s on top of the s/2 bound (relative 2^-24 each, generous).
SLACK = 2.0**-20


def _block_scales(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block scale (the bound's s_b), from the quantizer's own scales."""
    _, scales = quantize(x, block)
    return scales.repeat_interleave(block)[: x.numel()]


@pytest.mark.parametrize("n, block", [(5000, 2048), (64, 16), (7, 3), (1, 2048)])
def test_round_trip_within_half_a_step(n, block):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    q, scales = quantize(x, block)
    assert q.dtype == torch.int8 and q.shape == (n,) and q.abs().max() <= 127
    assert scales.dtype == torch.float32 and scales.shape == (math.ceil(n / block),)
    err = (x - dequantize(q, scales, block)).abs()
    assert (err <= _block_scales(x, block) * (0.5 + SLACK)).all()
    # the bound in relative terms: max|x| / 254 per block
    assert err.max() <= x.abs().max() / 254 * (1 + SLACK)


def test_exact_for_representable_values_and_zero_blocks():
    ks = torch.randint(-127, 128, (300,), generator=torch.Generator().manual_seed(1))
    ks[0], ks[250] = 127, -127  # blocks 0 and 2: absmax 127 · 2^-5, so scale 2^-5 exactly
    x = ks.float() * 2.0**-5
    x[100:200] = 0  # block 1: all zero
    q, scales = quantize(x, 100)
    assert scales.tolist() == [2.0**-5, 0.0, 2.0**-5] and (q[100:200] == 0).all()
    assert torch.equal(q, ks.masked_fill(x == 0, 0).to(torch.int8))
    assert torch.equal(dequantize(q, scales, 100), x)


def test_short_last_block_and_dtypes():
    x = torch.randn(2 * 8 + 3).to(torch.bfloat16)
    q, scales = quantize(x, 8)
    assert q.numel() == 19 and scales.numel() == 3  # no padding kept or sent
    assert quantized_nbytes(19, 8) == 19 + 4 * 3
    tail = x[16:].float()
    assert scales[2] == tail.abs().max() / 127  # the short block's own absmax
    back = dequantize(q, scales, 8, torch.bfloat16)
    assert back.dtype == torch.bfloat16 and back.shape == (19,)


def test_non_finite_stays_non_finite_blockwise():
    x = torch.randn(40)
    x[3], x[15], x[33] = float("inf"), float("nan"), -float("inf")
    q, scales = quantize(x, 10)
    assert not torch.isfinite(scales[[0, 1, 3]]).any() and torch.isfinite(scales[2])
    back = dequantize(q, scales, 10)
    assert back[:20].isnan().all() and back[30:].isnan().all()  # whole blocks
    assert torch.isfinite(back[20:30]).all()


def test_deterministic_and_half_to_even():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(2))
    a, b = quantize(x, 256), quantize(x.clone(), 256)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # scale 1 (absmax 127): 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0
    q, _ = quantize(torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5]), 8)
    assert q.tolist() == [127, 0, 2, 2, 0]


def test_rows_never_share_a_block():
    x = torch.randn(3, 10)
    x[1] *= 1000
    q, scales = _quantize_rows(x, 4)
    assert scales.shape == (3, 3)
    for r in range(3):
        assert torch.equal(_dequantize_rows(q, scales, 4)[r], dequantize(*quantize(x[r], 4), 4))


def test_bad_block_and_bytes():
    with pytest.raises(ValueError, match="block=0"):
        quantize(torch.ones(4), 0)
    assert QUANT_BLOCK == 2048 and quantized_nbytes(4096) == 4096 + 8
    # ring accounting: (N-1) slots of n + 4⌈n/B⌉ bytes, for either kind
    assert quantized_ring_bytes("all_gather", 1000, 4, 256) == 3 * (1000 + 16)
    assert quantized_ring_bytes("reduce_scatter", 1000, 4, 256) == 3 * (1000 + 16)
    with pytest.raises(ValueError, match="all_reduce"):
        quantized_ring_bytes("all_reduce", 10, 2)


SHARD, SLOT, BLOCK = 1000, 700, 256  # neither a multiple of the block: short last blocks


def _inputs(world: int, numel: int, seed: int) -> list[torch.Tensor]:
    """Every rank's input, built on every rank from one seed, so each rank has the oracle."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) * (1 + j) for j in range(world)]


def _rank_cases():
    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # on every rank, in order
    res = {}
    for name, group, members in (("world", None, [0, 1, 2, 3]),
                                 ("half", halves[rank // 2], [rank // 2 * 2, rank // 2 * 2 + 1])):
        k, me = len(members), members.index(rank)
        for dtype in (torch.float32, torch.bfloat16):
            xs = [x.to(dtype) for x in _inputs(k, SHARD, 10)]
            got = torch.empty(k * SHARD, dtype=dtype)
            quantized_all_gather(got, xs[me], group, BLOCK)
            want = torch.cat([dequantize(*quantize(x, BLOCK), BLOCK, dtype) for x in xs])
            exact = torch.cat(xs).double()
            cast = 2.0**-8 if dtype == torch.bfloat16 else 0.0  # the cast into out's dtype
            bound = torch.cat([_block_scales(x, BLOCK) for x in xs]).double() * (0.5 + SLACK)
            err = (got.double() - exact).abs()
            res[name, "ag", dtype] = (torch.equal(got, want),
                                      bool((err <= bound + exact.abs() * cast).all()),
                                      (err.norm() / exact.norm()).item())

            gs = [g.to(dtype) for g in _inputs(k, k * SLOT, 20)]
            before = gs[me].clone()
            out = torch.empty(SLOT, dtype=dtype)
            work = quantized_reduce_scatter(out, gs[me], group, BLOCK, k, async_op=True)
            work.wait()
            work.wait()  # a second wait does nothing
            mine = [g.view(k, SLOT)[me] for g in gs]
            acc = dequantize(*quantize(mine[0], BLOCK), BLOCK)
            for m in mine[1:]:
                acc += dequantize(*quantize(m, BLOCK), BLOCK)
            exact = sum(m.double() for m in mine) / k
            bound = sum(_block_scales(m, BLOCK).double() for m in mine) / k * (0.5 + SLACK)
            err = (out.double() - exact).abs()
            res[name, "rs", dtype] = (
                torch.equal(out, (acc / k).to(dtype)) and torch.equal(gs[me], before),
                bool((err <= bound * (1 + cast) + exact.abs() * cast).all()),
                (err.norm() / exact.norm()).item())
        # a non-finite gradient on one rank reaches every rank's sum, blockwise
        g = torch.ones(k * SLOT)
        if me == 0:
            g[k * SLOT - 1] = float("inf")  # the last rank's slot, its last block
        out = torch.empty(SLOT)
        quantized_reduce_scatter(out, g, group, BLOCK)
        res[name, "nonfinite"] = (out[-(SLOT % BLOCK):].isnan().all().item()
                                  if me == k - 1 else True,
                                  torch.isfinite(out[: SLOT - SLOT % BLOCK]).all().item())
    return res


@pytest.mark.dist
def test_quantized_collectives_on_gloo():
    res = spawn(_rank_cases, 4, timeout=120)
    for r in res:
        for key, val in r.items():
            if key[1] in ("ag", "rs"):
                # bit for bit equal to the oracle, every element within its bound, and
                # the relative L2 error vs the exact collective (Gaussian inputs, block
                # 256): about s/√12 per element, s ≈ 3σ/127, so ≈ 0.7%
                oracle, within, rel = val
                assert oracle and within and rel < 1e-2, (key, val)
            else:
                assert all(val), (key, val)


def _nccl_one_rank():
    """On one CUDA rank over NCCL: both collectives against the CPU oracle."""
    x = torch.randn(3 * SLOT, generator=torch.Generator().manual_seed(3))
    ag, rs = torch.empty(3 * SLOT, device="cuda"), torch.empty(3 * SLOT, device="cuda")
    quantized_all_gather(ag, x.cuda(), None, BLOCK)
    quantized_reduce_scatter(rs, x.cuda(), None, BLOCK, 1)
    want = dequantize(*quantize(x, BLOCK), BLOCK)
    return torch.equal(ag.cpu(), want), torch.equal(rs.cpu(), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_bit_for_bit():
    """IEEE division and round-half-to-even on both devices: the same q and scales, so
    ranks on CPU and GPU (and the oracle) agree; and NCCL runs the int8 collectives."""
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(4)) * 5
    x[17] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        cq, cs = quantize(x.to(dtype), QUANT_BLOCK)
        gq, gs = quantize(x.to(dtype).cuda(), QUANT_BLOCK)
        assert torch.equal(cq, gq.cpu())
        torch.testing.assert_close(gs.cpu(), cs, rtol=0, atol=0, equal_nan=True)
    assert all(spawn(_nccl_one_rank, 1, backend="nccl", timeout=120)[0])
