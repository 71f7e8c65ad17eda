"""Activation checkpointing (``ZeroConfig.activation_checkpointing``, ``runtime/
checkpointing.py``) on real gloo ranks: every mode at every stage (1 and 2 in the slow
tier) trains the built-in GPT,
a Hugging Face Llama and GPT-2 (with its dropout) bit for bit as keeping every
activation does, in fp32 and under bf16 — a recompute is the same maths; and beside
LoRA, ``model.compile()``, tensor parallelism, offload and generation, and a model that
checkpoints itself is left alone."""

from __future__ import annotations

import pytest

from zeroshard.runtime.spawn import spawn

from . import checkpointing_cases as cc

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def parity():
    return spawn(cc.parity_grid, 2, timeout=600)


def _exact(results, model, stage, mode) -> None:
    for rank, r in enumerate(results):
        case = r[(model, stage, mode)]
        assert case["exact"], (rank, case)
        assert case["wrapped"] == (1 if mode == 2 else 2), case


@pytest.mark.parametrize("mode", cc.MODES[1:], ids=str)
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("model", cc.MODELS)
def test_each_mode_trains_as_keeping_everything(parity, model, stage, mode):
    """3 AdamW steps: the losses and the full weights bit for bit those of the run that
    keeps every activation, on both ranks; every block unit wrapped (every second one
    with k = 2)."""
    _exact(parity, model, stage, mode)


@pytest.mark.slow
def test_each_mode_at_stages_1_and_2():
    results = spawn(cc.parity_grid, 2, cc.MODELS, (1, 2), False, timeout=600)
    for model in cc.MODELS:
        for stage in (1, 2):
            for mode in cc.MODES[1:]:
                _exact(results, model, stage, mode)


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("model", cc.MODELS)
def test_bf16_within_1e6(parity, model, stage, mode):
    for r in parity:
        case = r[(model, stage, mode, "bf16")]
        assert case["loss"] <= 1e-6 and case["weights"] <= 1e-6, case


@pytest.fixture(scope="module")
def features():
    """Full checkpointing beside each feature (selective: the slow tier's)."""
    return spawn(cc.features_grid, 2, ("full",), timeout=600)


@pytest.mark.parametrize("feature", ["lora", "compile", "tp", "offload"])
def test_beside_each_feature(features, feature, mode="full"):
    """peft's LoRA on the Llama, each unit compiled, tensor parallelism over both ranks,
    the optimizer in host memory: exact against the same run without checkpointing."""
    for r in features:
        case = r[(feature, mode)]
        assert case["exact"] and case["wrapped"] == 2, case


def test_a_compiled_unit_runs_compiled_in_its_recompute_too(features):
    """Two block units, 3 steps: 6 compiled forwards, and 6 recomputes through them."""
    for r in features:
        assert r[("compile", "full")]["graphs"] == 12


@pytest.mark.slow
def test_selective_beside_each_feature():
    for r in spawn(cc.features_grid, 2, ("selective",), timeout=600):
        for feature in ("lora", "compile", "tp", "offload"):
            case = r[(feature, "selective")]
            assert case["exact"] and case["wrapped"] == 2, (feature, case)
        assert r[("compile", "selective")]["graphs"] == 12
        assert r[("generate", "selective")]


@pytest.mark.parametrize("mode", ["full"])
def test_generation_is_not_checkpointed(features, mode):
    """generate() at stage 3 after a step: the tokens of the model without checkpointing
    (no cache is dropped outside training)."""
    assert all(r[("generate", mode)] for r in features)


@pytest.mark.parametrize("lora", [False, True], ids=["llama", "peft"])
def test_a_model_that_checkpoints_itself_is_not_wrapped_twice(features, lora):
    for r in features:
        case = r["itself", "lora"] if lora else r["itself"]
        assert case["wrapped"] == 0 and case["exact"], case
        assert len(case["warned"]) == 1 and "does not wrap it twice" in case["warned"][0]


def test_a_model_of_one_unit_is_told_nothing_is_checkpointed(features):
    """``units=None`` makes the whole model the root unit, which is never checkpointed: a
    warning says so rather than a silent no-op."""
    for r in features:
        wrapped, said = r["one unit"]
        assert wrapped == 0 and said == [
            "activation_checkpointing='full': the model has 0 unit(s) besides the root, so "
            "no unit is checkpointed; shard it in blocks (units='blocks', the default) to "
            "checkpoint them"]
