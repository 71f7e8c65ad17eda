"""Optimizer and parameter offload on real gloo ranks (N = 2). On this CPU-only machine
the "device" is the CPU too, but offloaded state lives in separate host buffers and
moves exactly as it would to and from a GPU, so exactness and the ledger by placement
are tested here: 20 AdamW steps give weights bit for bit equal to the same run without
offload, at stages 1-3, in fp32 and bf16."""

import os

import pytest
import torch

import zeroshard as zs
from zeroshard.offload import HostAdamW
from zeroshard.runtime.spawn import spawn

from . import engine_cases as cases

pytestmark = pytest.mark.dist


def _run(stage, precision, offload, optim="adamw", micros=1):
    net = zs.shard(cases.build("gpt"), stage=stage, mixed_precision=precision, offload=offload)
    params = list(net.parameters())
    opt = (HostAdamW(params, lr=1e-3, weight_decay=0.1) if optim == "host" else
           torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=optim == "fused"))
    for step in range(20):
        for micro in range(micros):  # accumulation: each landing goes to the host
            net(*cases.batch("gpt", step, micro, micros)).backward()
        net.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    net(*cases.batch("gpt", 20)).backward()
    seen = []
    hook = opt.register_step_pre_hook(lambda o, a, k: seen.append(net.memory(o, True)))
    opt.step()
    hook.remove()
    return net, opt, {"weights": net.full_state_dict(), "placed": seen[0]}


def _grid(root):
    out = {}
    for precision in (None, "bf16"):
        for stage in (1, 2, 3):
            for offload in (None, "optimizer") + (("params",) if stage == 3 else ()):
                net, opt, r = _run(stage, precision, offload)
                out[(precision, stage, offload)] = r
                if (precision, stage, offload) == ("bf16", 3, "optimizer"):
                    zs.save(net, opt, os.path.join(root, "offloaded"), extra={"step": 21})
    for offload in (None, "optimizer"):  # two micro-batches per step
        out[("accumulated", offload)] = _run(2, "bf16", offload, micros=2)[2]
    # the host step: HostAdamW on offloaded shards is torch's fused AdamW, bit for bit
    out["host"] = _run(3, "bf16", "optimizer", optim="host")[2]
    out["fused"] = _run(3, "bf16", None, optim="fused")[2]
    # a checkpoint of an offloaded run loads without offload, and the reverse
    plain = zs.shard(cases.build("gpt"), stage=2, mixed_precision="bf16")
    zs.load(plain, torch.optim.AdamW(plain.parameters()), os.path.join(root, "offloaded"))
    out["loaded plainly"] = plain.full_state_dict()
    back = zs.shard(cases.build("gpt"), stage=1, mixed_precision="bf16", offload="optimizer")
    zs.load(back, torch.optim.AdamW(back.parameters()), os.path.join(root, "offloaded"))
    out["loaded offloaded"] = back.full_state_dict()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(_grid, 2, str(tmp_path_factory.mktemp("offload")), timeout=600)


@pytest.mark.parametrize("precision", [None, "bf16"])
@pytest.mark.parametrize("stage,offload", [(1, "optimizer"), (2, "optimizer"),
                                           (3, "optimizer"), (3, "params")])
def test_offload_is_exact(ranks, precision, stage, offload):
    for r in ranks:
        assert cases.bit_equal(r[(precision, stage, offload)]["weights"],
                               r[(precision, stage, None)]["weights"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_ledger_by_placement(ranks, stage):
    """Offloaded, the master and the optimizer state are on the host and nothing of them
    on the device; the step's fp32 gradients too; the rest stays on the device."""
    plain = ranks[0][("bf16", stage, None)]["placed"]
    placed = ranks[0][("bf16", stage, "optimizer")]["placed"]
    assert plain["host"]["optimizer"] == 0 and plain["device"]["optimizer"] > 0
    assert placed["host"]["optimizer"] == plain["device"]["optimizer"]
    assert placed["device"]["optimizer"] == 0
    assert placed["device"]["params"] == plain["device"]["params"]
    assert placed["device"]["grads"] == plain["device"]["grads"]
    if stage == 3:
        params = ranks[0][("bf16", 3, "params")]["placed"]
        assert params["host"]["params"] == plain["device"]["params"] > 0
        assert params["device"]["params"] == 0


def test_offload_is_exact_with_accumulation(ranks):
    for r in ranks:
        assert cases.bit_equal(r[("accumulated", "optimizer")]["weights"],
                               r[("accumulated", None)]["weights"])


def test_host_adamw_is_fused_adamw_bit_for_bit(ranks):
    for r in ranks:
        assert cases.bit_equal(r["host"]["weights"], r["fused"]["weights"])


def test_checkpoints_load_across_offload_modes(ranks):
    for r in ranks:
        saved = r[("bf16", 3, "optimizer")]["weights"]
        assert cases.bit_equal(r["loaded plainly"], saved)
        assert cases.bit_equal(r["loaded offloaded"], saved)


@pytest.mark.parametrize("options,message", [
    ({"stage": 0, "offload": "optimizer"}, "stage 0 shards nothing: use stage 1-3"),
    ({"stage": 2, "offload": "params"}, "offload='params' keeps the weight shards on the "
                                        "host, which only stage 3 has"),
    ({"offload": "nvme"}, "offload='nvme'; expected None, 'optimizer' or 'params'"),
])
def test_bad_offload_options_are_named(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        zs.ZeroConfig(**options)
