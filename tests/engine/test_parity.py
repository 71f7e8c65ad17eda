"""Training parity at N = 2 on real gloo processes: after 10 steps stages 0-3 agree bit
for bit and stay within 1e-6 of torch DDP under each elementwise optimizer (AdamW, AdamW
with decay/no-decay groups, SGD with momentum, Adagrad, RMSprop); an optimizer that is
not elementwise and that the engine cannot step exactly is refused; and every rank
starts from rank 0's parameters and buffers.
Clipping, accumulation and bf16 have their own files; N = 3 is in test_layout.py, N = 4
in test_reduction.py."""

import pytest

from zeroshard.runtime.spawn import spawn

from . import engine_cases as cases

pytestmark = pytest.mark.dist


def _grid():
    return {
        "parity": cases.parity_grid(["mlp", "gpt"], ["plain", "groups", "sgd"], steps=10),
        "optimizers": cases.parity_grid(["mlp"], ["adagrad", "rmsprop"], steps=10),
        "refusals": cases.refusal_grid(),
        "broadcast": cases.broadcast_from_rank0(),
    }


@pytest.fixture(scope="module")
def grid():
    return spawn(_grid, 2, timeout=600)[0]


@pytest.mark.parametrize("model", ["mlp", "gpt"])
@pytest.mark.parametrize("variant", ["plain", "groups", "sgd"])
def test_fp32_parity_n2(grid, model, variant):
    r = grid["parity"][(model, variant)]
    assert max(r["diff_to_ddp"]) < cases.TOL, r["diff_to_ddp"]
    assert all(r["bit_equal_to_stage0"]), r
    # stage 0's default, DDP's 25 MiB bucket (the whole model here): two ranks' sums in
    # any buffer are one addition, so the same bits as unit by unit
    assert r["bucketed_bit_equal"], r


@pytest.mark.parametrize("variant", ["adagrad", "rmsprop"])
def test_other_elementwise_optimizers(grid, variant):
    r = grid["optimizers"][("mlp", variant)]
    assert all(r["bit_equal_to_stage0"]) and max(r["diff_to_ddp"]) < cases.TOL, r


def test_non_elementwise_optimizers_refused(grid):
    b = grid["refusals"]
    # (Adafactor, Muon and LAMB step shards exactly: tests/engine/test_optimizers.py)
    assert "Shampoo cannot step ZeRO stage 1 shards" in b[(1, "Shampoo")]
    assert "preconditioners are built from whole matrices" in b[(1, "Shampoo")]
    assert "LBFGS cannot step ZeRO stage 2 shards" in b[(2, "LBFGS")]
    assert b[(3, "Shampoo")] is not None
    assert b[(0, "Shampoo")] is None  # stage 0 steps whole parameters


def test_rank0_parameters_and_buffers_everywhere(grid):
    assert grid["broadcast"]
