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


def _grid():
    return {"parity": cases.parity_grid(MODELS, ["plain"], steps=10), "meta": _meta_init()}


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
