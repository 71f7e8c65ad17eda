"""The slow tier's grids: at N = 2 and N = 4 a tiny Llama and GPT-2 at every stage, LoRA
at stages 1-2, TRL's SFTTrainer at every stage, each against the same Trainer's own DDP
run; checkpoints resumed at another number of ranks (Hugging Face: saved at N = 4,
resumed at N = 2; Lightning: saved at N = 2, resumed at N = 1), each against the run
that was not interrupted."""

from __future__ import annotations

import pytest

from zeroshard.runtime.spawn import spawn

from . import hf_cases, lightning_cases
from . import models as m
from .conftest import ok
from .test_hf_trainer import WEIGHTS, _matches

pytestmark = [pytest.mark.slow, pytest.mark.dist]


@pytest.fixture(scope="module", params=[2, 4])
def wide(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(f"wide{request.param}"))
    return spawn(hf_cases.wide_grid, request.param, folder, timeout=1200)[0]


@pytest.mark.parametrize("model", ["llama", "gpt2"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_both_models_at_every_stage(wide, model, stage):
    _matches(ok(wide[model])[stage])


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_lora_with_checkpointing_at_stages_0_to_2(wide, stage):
    r = ok(wide["peft"])[stage]
    _matches(r)
    assert r["logits"] <= WEIGHTS


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sft_at_every_stage(wide, stage):
    _matches(ok(wide["sft"])[stage])


@pytest.mark.parametrize("stage", [3, 1])
def test_hf_checkpoint_resumes_at_another_world(tmp_path, stage):
    """Saved at N = 4 (1 sequence per rank and micro-batch), resumed at N = 2 (2 per rank:
    the same 4 sequences per micro-batch): the end of the uninterrupted N = 4 run."""
    folder = str(tmp_path)
    end = spawn(hf_cases.save_for_another_world, 4, folder, timeout=600)[0]["end"]
    got = spawn(hf_cases.resume_in_another_world, 2, folder, stage, timeout=600)[0]["end"]
    assert m.weights_diff(got, end) <= WEIGHTS


def test_lightning_checkpoint_resumes_at_another_world(tmp_path):
    """Saved at N = 2 (batches of 4), resumed at N = 1 (batches of 8: the same samples a
    step): the end of the uninterrupted N = 2 run."""
    folder = str(tmp_path)
    saved = spawn(lightning_cases.save_for_another_world, 2, folder, timeout=600)[0]
    got = spawn(lightning_cases.resume_in_another_world, 1, folder, saved["first"], 3,
                timeout=600)[0]["end"]
    assert m.weights_diff(got, saved["end"]) <= 1e-5


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_grpo_at_the_other_stages(wide, stage):
    _matches(ok(wide["grpo"])[stage])
