"""Models beyond the built-in GPT, each against torch DDP on the same global batch:
tied weights in different units, frozen and sometimes-unused parameters, activation
checkpointing, Hugging Face GPT-2 and Llama, and construction on the meta device."""

import pytest
import torch

import zeroshard as zs
from zeroshard.models.gpt import GPT
from zeroshard.runtime.spawn import spawn

from . import engine_cases as cases

pytestmark = pytest.mark.dist

MODELS = ["gpt_tied_units", "gpt_frozen_skip", "gpt_ckpt", "gpt_persist", "gpt_reorder",
          "hf_gpt2", "hf_llama"]


def _meta_init():
    out = {}
    for stage in range(4):
        with torch.device("meta"):
            meta = GPT(cases.GPT_SMALL)
        net = zs.shard(meta, stage=stage, param_init=GPT.init_module, seed=5)
        out[stage] = net.full_state_dict()
        out[("tied", stage)] = net.module.head.weight is net.module.wte.weight
    ref = GPT(cases.GPT_SMALL)
    zs.init_weights(ref, seed=5, param_init=GPT.init_module)
    out["reference"] = ref.state_dict()
    return out


def _persistent():
    """Stage 3 with biases and norms (< 100 elements) kept whole: what each rank holds."""
    net = zs.shard(cases.build("gpt_persist"), stage=3, param_persistence_threshold=100)
    small = sum(p.numel() for p in cases.build("gpt").parameters() if p.numel() < 100)
    big = sum(p.numel() for p in cases.build("gpt").parameters() if p.numel() >= 100)
    x, y = cases.batch("gpt", 0)
    net(x, y).backward()
    calls = net.comm_stats()["all_gather"]["calls"]
    # read once the engine's step pre-hook has landed every reduction
    opt, seen = torch.optim.SGD(net.parameters(), lr=0.0), []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(net.memory()))
    opt.step()
    return {"memory": seen[0], "small": small, "big": big, "gathers": calls,
            "units": len(net.units)}


def _prefetch():
    """States of block 2's unit when block 1 starts, per prefetch depth; and weights."""
    out = {"reorder": {}}
    for depth in (0, 1):  # the order changes every step: prefetch must not change results
        net = zs.shard(cases.build("gpt_reorder"), stage=3, prefetch=depth)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        for step in range(4):
            net.module.skip = step % 2 == 1
            x, y = cases.batch("gpt", step)
            net(x, y).backward()
            opt.step()
            opt.zero_grad()
        out["reorder"][depth] = net.full_state_dict()
    for depth in (0, 1, 2):
        net = zs.shard(cases.build("gpt_ckpt"), stage=3, prefetch=depth)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        seen = []
        blocks = net.module.blocks
        blocks[1].register_forward_pre_hook(
            lambda m, a, net=net, seen=seen: seen.append((net.units[3].state.value,
                                                          net.units[1].state.value)))
        for step in range(3):
            x, y = cases.batch("gpt", step)
            net(x, y).backward()
            opt.step()
            opt.zero_grad()
        out[depth] = {"seen": seen, "weights": net.full_state_dict(),
                      "gathers": net.comm_stats()["all_gather"]["calls"]}
    return out


def _buckets():
    """Weights after 3 steps and reductions per step, one collective per unit or one
    bucket for the whole model, per stage."""
    out = {}
    for stage in range(4):
        for size in (0, 10**9):
            net = zs.shard(cases.build("gpt"), stage=stage, reduce_bucket_size=size)
            opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
            for step in range(3):
                x, y = cases.batch("gpt", step)
                net(x, y).backward()
                opt.step()
                opt.zero_grad()
            kind = "all_reduce" if stage == 0 else "reduce_scatter"
            out[(stage, size)] = (net.full_state_dict(), net.comm_stats()[kind]["calls"] / 3)
    return out


def _grid():
    return {"parity": cases.parity_grid(MODELS, ["plain"], steps=10), "meta": _meta_init(),
            "persistent": _persistent(), "prefetch": _prefetch(), "buckets": _buckets()}


@pytest.fixture(scope="module")
def grid():
    return spawn(_grid, 2, timeout=600)[0]


@pytest.mark.parametrize("model", MODELS)
def test_parity_with_ddp(grid, model):
    r = grid["parity"][(model, "plain")]
    assert all(r["bit_equal_to_stage0"]), r
    assert max(r["diff_to_ddp"]) < 1e-6, r


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_meta_init_equals_seeded_unsharded_model(grid, stage):
    assert cases.bit_equal(grid["meta"][stage], grid["meta"]["reference"])
    assert grid["meta"][("tied", stage)]


def test_persistence_threshold_keeps_small_parameters_whole(grid):
    r = grid["persistent"]
    # weights: every small parameter whole, the rest halved; gradients all sharded
    assert r["memory"]["params"] == 4 * (r["small"] + r["big"] // 2)
    assert r["memory"]["grads"] == 4 * (r["small"] + r["big"]) // 2
    # the persistent unit is never gathered: 4 gathered units x (forward + backward)
    assert r["units"] == 5 and r["gathers"] == 2 * 4


def test_prefetch_overlaps_without_changing_results(grid):
    r = grid["prefetch"]
    # (block 2, block 0) when block 1 starts: in forward, and again in backward, where
    # activation checkpointing recomputes it. Nothing is recorded on the first pass.
    assert set(r[0]["seen"]) == {("sharded", "sharded")}
    forward, backward = r[1]["seen"][0::2], r[1]["seen"][1::2]
    assert forward == [("sharded", "sharded")] + [("gathering", "sharded")] * 2
    assert backward == [("sharded", "sharded")] + [("sharded", "gathering")] * 2
    # the same weights and the same number of gathers at every depth
    assert cases.bit_equal(r[1]["weights"], r[0]["weights"])
    assert cases.bit_equal(r[2]["weights"], r[0]["weights"])
    assert r[0]["gathers"] == r[1]["gathers"] == r[2]["gathers"]
    assert cases.bit_equal(r["reorder"][1], r["reorder"][0])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reduce_bucket_coalesces_units(grid, stage):
    b = grid["buckets"]
    (alone, per_unit), (bucketed, per_bucket) = b[(stage, 0)], b[(stage, 10**9)]
    assert per_unit == 4 and per_bucket == 1  # root + 3 blocks, or one bucket
    assert cases.bit_equal(bucketed, alone)
    assert cases.bit_equal(bucketed, b[(0, 10**9)][0])
