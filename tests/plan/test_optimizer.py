"""The planner's optimizers (``zeroshard plan --optimizer``): architectures' shapes add up
to their parameter counts, each optimizer's state and bytes follow its rule, owners are
balanced by cost and independent of the order, the recipes and the command. Pure unit
tests: no torch, no processes (the engine's side is tests/engine/test_optimizers.py)."""

import json
import math
import subprocess
import sys

import pytest

from zeroshard.plan.arch import PRESETS, ModelSpec
from zeroshard.plan.comm import owner_comm, reduction_comm
from zeroshard.plan.memory import plan_strategy
from zeroshard.plan.placement import _shaped_state as state_bytes
from zeroshard.plan.shapes import arch_shapes
from zeroshard.spec.config import ZeroConfig
from zeroshard.spec.dims import ParallelDims
from zeroshard.spec.optimizers import (
    OPTIMIZERS,
    assign_owners,
    newton_schulz_flops,
    owner_bytes,
    state_elements,
)
from zeroshard.spec.recipes import get_recipe


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_shapes_add_up_to_the_parameter_count(name):
    assert sum(math.prod(s) for s in arch_shapes(PRESETS[name])) == PRESETS[name].params


def test_state_elements_per_optimizer():
    muon, ada, adamw = OPTIMIZERS["muon"], OPTIMIZERS["adafactor"], OPTIMIZERS["adamw"]
    assert state_elements(adamw, (8, 4), 8) == 64
    assert state_elements(muon, (8, 4), 8) == 32  # one moment
    assert state_elements(muon, (8,), 8) == 16  # AdamW's two for the rest
    assert state_elements(ada, (8, 4), 8) == 8 + 4  # row_var [8, 1], col_var [1, 4]
    assert state_elements(ada, (8, 4), 2) == 2 + 4  # 2 rows held: the columns whole
    assert state_elements(ada, (6, 8, 4), 3) == 3 * 8 + 3 * 4  # [3, 8, 1] and [3, 1, 4]
    assert state_elements(ada, (8,), 4) == 4  # variance of the rows held


def test_owners_balance_the_newton_schulz_cost_whatever_the_order():
    shapes = [(64, 64), (32, 128), (128, 32), (16, 16), (64, 64), (8, 256)]
    owners = assign_owners(shapes, 3)
    load = [sum(newton_schulz_flops(s, 5) for s, o in zip(shapes, owners) if o == r)
            for r in range(3)]
    assert max(load) <= 4 / 3 * sum(load) / 3 + max(newton_schulz_flops(s, 5) for s in shapes)
    reordered = shapes[::-1]
    for r in range(3):  # the bytes a rank sends depend on the shapes alone
        assert owner_bytes(shapes, 3, r, 4) == owner_bytes(reordered, 3, r, 4)


def test_owner_bytes_count_what_leaves_each_rank():
    # one 10 x 4 matrix over 2 ranks, owned by rank 0: rank 1 sends its 5 rows (fp32),
    # rank 0 sends rank 1 its 5 rows of the result (bf16)
    assert owner_bytes([(10, 4)], 2, 0, 4) == {"owner_gather": 0, "owner_scatter": 5 * 4 * 2}
    assert owner_bytes([(10, 4)], 2, 1, 4) == {"owner_gather": 5 * 4 * 4, "owner_scatter": 0}


def _config(stage, optimizer, precision="bf16-mixed-adamw"):
    return ZeroConfig(stage=stage, mixed_precision=get_recipe(precision).with_optimizer(optimizer))


def test_plan_counts_muon_and_adafactor_from_the_shapes():
    model, dims = ModelSpec.from_arch(PRESETS["llama2-7b"]), ParallelDims(8)
    shapes = arch_shapes(PRESETS["llama2-7b"])
    adamw = plan_strategy(model, dims, _config(1, "adamw"))
    muon = plan_strategy(model, dims, _config(1, "muon"))
    ada = plan_strategy(model, dims, _config(1, "adafactor"))
    assert ada.optimizer < muon.optimizer < adamw.optimizer
    master = math.ceil(4 * model.params / 8)
    assert muon.optimizer == master + state_bytes(shapes, dims, _config(1, "muon"))
    extra = sum(owner_comm(shapes, dims, _config(1, "muon")).values())
    assert muon.comm == adamw.comm + extra and extra > 0
    assert ada.comm == adamw.comm + reduction_comm(shapes, dims, _config(1, "adafactor"))
    # stage 0 steps whole parameters: no exchange of its own
    assert plan_strategy(model, dims, _config(0, "muon")).comm == plan_strategy(
        model, dims, _config(0, "adamw")).comm


def test_recipes_and_refusals():
    r = get_recipe("bf16-mixed-adamw").with_optimizer("muon")
    assert r.name == "bf16-mixed-muon" and r.optimizer_states == 1 and r.shaped_state
    assert get_recipe("fp32-adamw").with_optimizer("adafactor").name == "fp32-adafactor"
    with pytest.raises(ValueError, match="optimizer='rmsprop'; expected one of adamw"):
        get_recipe("fp32-adamw").with_optimizer("rmsprop")
    bare = ModelSpec("bare", 1000)
    with pytest.raises(ValueError, match="depends on each parameter's shape"):
        plan_strategy(bare, ParallelDims(2), _config(1, "muon"))
    with pytest.raises(ValueError, match="tensor parallelism"):
        state_bytes([(4, 4)], ParallelDims(4, tp=2), _config(1, "muon"))


def test_the_plan_command_takes_an_optimizer():
    out = subprocess.run([sys.executable, "-m", "zeroshard", "plan", "--model", "llama2-7b",
                          "--gpus", "8", "--optimizer", "muon", "--json"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    report = json.loads(out)
    plans = {p["strategy"]: p for p in report["strategies"]}
    assert report["recipe"] == "bf16-mixed-muon"
    assert round(plans["ZeRO-1"]["optimizer"] / 1e9, 2) == 6.74, plans["ZeRO-1"]
