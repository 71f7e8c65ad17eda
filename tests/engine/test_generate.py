"""Generation on a sharded model ([Note: generation] in ``runtime/cycle.py``), on real
gloo ranks: ranks that ask for different lengths, or whose sequences meet an eos at
different steps, finish at stage 3 with the unsharded model's tokens — the weights
gathered once, or unit by unit with ``synced_gpus`` — peft's model too; a GRPO-shaped loop
(generate, score, step against a frozen reference sharded beside) equals torch DDP at
stages 0-3, samples included; a fully frozen model is a teacher, not a mistake."""

from __future__ import annotations

import pytest

from zeroshard.runtime.spawn import spawn

from . import generate_cases as gc

pytestmark = pytest.mark.dist

#: The spawns' limit: a rank left waiting for a gather would run into it.
TIMEOUT = 240


@pytest.fixture(scope="module")
def uneven():
    return spawn(gc.uneven_grid, 2, timeout=TIMEOUT)


@pytest.mark.parametrize("lora", [False, True], ids=["llama", "peft"])
@pytest.mark.parametrize("mode", ["whole", "unit"])
def test_ranks_that_stop_at_different_lengths_finish_with_the_unsharded_tokens(uneven, mode,
                                                                               lora):
    for rank, r in enumerate(uneven):
        case = r[(mode, lora)]
        assert case["equal"], (rank, case)
        assert case["whole"] is (mode == "whole")
    # the lengths differ between the ranks: rank 1 asked for more, rank 0's eos came early
    lengths = [r[(mode, lora)]["lengths"] for r in uneven]
    assert lengths[0] != lengths[1], lengths


def test_the_whole_model_is_released_after_generate(uneven):
    """The ledger's gathered bytes after generate() are what they were before it (the
    stage-3 figure): the full weights were held for the generation alone."""
    for r in uneven:
        for case in r.values():
            assert case["gathered_after"] == case["gathered_before"] == 0, case


@pytest.fixture(scope="module")
def loop():
    return spawn(gc.grpo_grid, 2, timeout=600)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_grpo_loop_equals_ddp(loop, stage):
    """5 iterations of sample (an eos ends some completions early, at different steps on
    each rank), reward, group-relative advantage, loss with a KL penalty against a frozen
    reference model sharded at stage 3 beside the policy, clip, step: the same samples as
    DDP's, and the weights within 1e-5 of DDP's."""
    for rank, r in enumerate(loop):
        case = r[stage]
        assert case["samples_equal"], (rank, stage)
        assert case["diff"] < 1e-5, (rank, stage, case["diff"])
    assert any(r[stage]["ended_early"] for r in loop)


def test_a_frozen_model_is_a_teacher():
    """Every parameter frozen is a valid model to shard (a distillation teacher, a DPO or
    GRPO reference): its logits are the unsharded model's, it holds no gradient and no
    optimizer state, and a student trains against it."""
    for r in spawn(gc.frozen_teacher, 2, timeout=TIMEOUT):
        assert r["teacher_diff"] < 1e-6, r
        assert r["memory"]["grads"] == 0 and r["memory"]["optimizer"] == 0, r["memory"]


@pytest.mark.slow
def test_four_ranks_stop_at_different_lengths_and_loop_as_ddp():
    """The same at N = 4: uneven lengths in both modes, and the loop at stages 0 and 3."""
    for rank, r in enumerate(spawn(gc.uneven_grid, 4, timeout=TIMEOUT)):
        assert all(case["equal"] for case in r.values()), (rank, r)
    for r in spawn(gc.grpo_grid, 4, (0, 3), timeout=600):
        assert all(c["samples_equal"] and c["diff"] < 1e-5 for c in r.values()), r
