"""zeroshard.hf.Trainer on 2 gloo ranks against transformers' own Trainer running DDP over
the plain model (same arguments, seeds and data: accumulation 2, max_grad_norm=1.0, linear
warm-up, weight decay): a tiny Llama at stages 0-3 and GPT-2 at stage 3, gradients reduced
once per step, resume, save_model, evaluate and predict, a DeepSpeed JSON of "auto"
values, LoRA with gradient checkpointing, TRL's SFTTrainer, bf16, an optimizer refused,
and transformers' own Trainer handed a sharded model."""

from __future__ import annotations

import math

import pytest

from zeroshard.runtime.spawn import spawn

from . import hf_cases
from .conftest import ok

#: The issue's bound on the weights (max abs) against DDP.
WEIGHTS = 1e-5


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    return spawn(hf_cases.main_grid, 2, str(tmp_path_factory.mktemp("hf")), timeout=600)[0]


def _same_norms(got: list, want: list) -> None:
    """The logged grad_norm of every step equals DDP's (one float32 rounding apart: the
    engine adds squares in float64)."""
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        assert math.isclose(a, b, rel_tol=1e-6), (got, want)


def _matches(r: dict) -> None:
    assert r["weights"] <= WEIGHTS, r["weights"]
    _same_norms(r["norms"], r["ref_norms"])
    assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-6)


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 3])  # 1 and 2: test_wide.py
def test_llama_at_stages_0_and_3_matches_ddp(grid, stage):
    _matches(ok(grid["llama"])[stage])


@pytest.mark.dist
def test_gpt2_at_stage_3_matches_ddp(grid):
    _matches(ok(grid["gpt2"])[3])


@pytest.mark.dist
def test_accumulation_reduces_once_per_optimizer_step(grid):
    calls = ok(grid["accumulation"])
    # 4 steps of 2 micro-batches: the collectives of 4 steps of 1 (no reduction per
    # micro-batch: the Trainer's no_sync reaches the sharded model's)
    assert calls["0/2"] == calls["0/1"] and calls["0/1"]["all_reduce"] > 0
    assert calls["3/2"] == calls["3/1"]
    assert calls["3/1"]["reduce_scatter"] == 4 * 3  # 4 steps x 3 units


@pytest.mark.dist
def test_resume_from_checkpoint_equals_the_uninterrupted_run(grid):
    r = ok(grid["resume"])
    assert {"zeroshard", "trainer_state.json", "scheduler.pt", "rng_state_0.pth",
            "rng_state_1.pth", "config.json"} <= set(r["files"])
    assert "model.safetensors" not in r["files"]  # nothing gathered at a save
    for stage in (3, 1):  # the same stage, and another
        assert r[stage]["weights"] <= WEIGHTS, (stage, r[stage]["weights"])
        assert r[stage]["norms"] == pytest.approx(r["norms"], rel=1e-6)


@pytest.mark.dist
def test_save_model_evaluate_and_predict(grid):
    r = ok(grid["outputs"])
    assert "model.safetensors" in r["files"] and "config.json" in r["files"]
    assert r["logits"] <= WEIGHTS  # from_pretrained gives the trained (DDP's) logits
    assert r["eval"][0] == pytest.approx(r["eval"][1], rel=1e-6)
    assert r["predict"] <= WEIGHTS and r["predict_shape"] == (8, 16, 128)


@pytest.mark.dist
def test_load_best_model_at_end(grid):
    r = ok(grid["best"])
    assert r["zs"]["best"] == r["ddp"]["best"]
    assert r["zs"]["evals"] == pytest.approx(r["ddp"]["evals"], rel=1e-6)
    assert r["zs"]["evals"].index(min(r["zs"]["evals"])) < 2  # the best is not the last
    assert r["weights"] <= WEIGHTS  # the best checkpoint's weights, as DDP ends with


@pytest.mark.dist
def test_deepspeed_json_with_auto_values(grid):
    r = ok(grid["deepspeed"])
    _matches(r["plain"])
    # stage 3, and the three sizes filled from hidden size 32 as the Trainer fills them
    assert r["config"] == [3, 32 * 32, int(0.9 * 32 * 32), 10 * 32]
    assert r["warnings"] == ["DeepSpeed config keys ignored by zeroshard: "
                             "zero_optimization.contiguous_gradients, "
                             "zero_optimization.overlap_comm"]
    _matches(r["sections"])  # DeepSpeed's AdamW and WarmupDecayLR
    assert r["lrs"][0] == r["lrs"][1] == [0.0, 0.0, 0.01, 0.01]


@pytest.mark.dist
@pytest.mark.parametrize("stage", [3])  # 0-2: test_wide.py
def test_lora_with_gradient_checkpointing(grid, stage):
    r = ok(grid["peft"])[stage]
    _matches(r)
    assert "adapter_model.safetensors" in r["files"]
    assert r["logits"] <= WEIGHTS  # peft's from_pretrained on a fresh base


@pytest.mark.dist
@pytest.mark.parametrize("stage", [3])  # 0-2: test_wide.py
def test_trl_sft_trainer_sharded(grid, stage):
    _matches(ok(grid["sft"])[stage])


@pytest.mark.dist
def test_trl_grpo_trainer_sharded_generates_and_trains_as_ddp(grid):
    """GRPOTrainer at stage 3: its generation (completions of different lengths, through
    the sharded model's generate) and its steps match its own DDP run."""
    r = ok(grid["grpo"])
    assert r["uneven"]
    _matches(r[3])


@pytest.mark.dist
def test_bf16_is_the_engine_recipe_close_to_ddp_autocast(grid):
    r = ok(grid["bf16"])
    assert r["recipe"] == "bf16-mixed-adamw" and r["dtypes"] == ["torch.bfloat16"]
    assert r["losses"] == pytest.approx(r["ref_losses"], rel=2e-3)


@pytest.mark.dist
def test_an_optimizer_that_cannot_step_shards_is_refused_when_built(grid):
    assert ok(grid["refused"])["line"].startswith(
        "optim='adafactor' builds transformers.optimization.Adafactor, which cannot step "
        "ZeRO stage 3 shards")


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 3])
def test_stock_trainer_with_a_sharded_model_stops_before_any_step(grid, stage):
    r = ok(grid[f"stock{stage}"])
    zeroshard = ("ValueError: zeroshard: a ShardedModel cannot be wrapped in torch "
                 "DistributedDataParallel")
    # the runs (columns kept; plain examples), and a datasets.Dataset with the
    # default remove_unused_columns (the sharded model's forward shows the module's
    # signature, so the Trainer keeps the columns it names): one line naming
    # zeroshard.hf.Trainer, before any step
    for case in ("columns kept", "examples", "datasets default"):
        assert r[case]["line"].startswith(zeroshard), r[case]
        assert "zeroshard.hf.Trainer" in r[case]["line"]
    assert all(v["moved"] == 0.0 for v in r.values())  # no step was taken
