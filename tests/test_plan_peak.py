"""The planned peak: the loss's backward, a unit's backward and the optimizer step, and
``--recommend`` held to it (issue #19's Llama-3-8B case replayed)."""

from __future__ import annotations

import pytest

from zeroshard.plan import ModelSpec, Workload, get_preset, get_recipe
from zeroshard.plan.hardware import Cluster, get_accelerator, get_network
from zeroshard.plan.peak import peak
from zeroshard.plan.recommend import recommend

BF16 = get_recipe("bf16-mixed-adamw")
GB = 10**9
H100 = Cluster(get_accelerator("h100"), get_network("nvlink4-ndr"), 8)
M7 = ModelSpec("7B-style", 6_738_149_376, hidden=4096, layers=32)


def test_step_holds_fp32_gradient_copies():
    """DDP on the 7B-style model: at the step the fp32 copies of all P gradients join
    the 16P of state (activations gone): 134.8 GB, where the source table's total is
    108.63; foreach AdamW adds sqrt(v) for every element, fused nothing."""
    fused = peak(M7, BF16, Workload(), 8, 0, optimizer_impl="fused")
    assert fused.moment == "optimizer step"
    assert fused.phases["optimizer step"] == 20 * M7.params
    assert round(fused.bytes / GB, 1) == 134.8
    foreach = peak(M7, BF16, Workload(), 8, 0)
    assert foreach.bytes - fused.bytes == 4 * M7.params
    # ZeRO-3: 16P/8 of state and 4P/8 of fp32 copies at the step
    z3 = peak(M7, BF16, Workload(), 8, 3, optimizer_impl="fused")
    assert z3.phases["optimizer step"] == -(-16 * M7.params // 8) + 4 * M7.params // 8


def test_root_unit_is_embeddings_and_head():
    arch = get_preset("llama3-8b")
    assert arch.root_params == 2 * 128256 * 4096 + 4096 == 1_050_677_248
    assert arch.root_params / (arch.params / arch.layers) == pytest.approx(4.19, abs=0.01)
    model = ModelSpec.from_arch(arch)
    p = peak(model, BF16, Workload(8192, 8192, flash_attention=True), 8, 3, prefetch=1)
    # stage 3 at the loss's backward: the root unit gathered, one block arriving
    assert p.root_gathered == 2 * (arch.root_params + arch.block_params)


def test_loss_path_of_llama3_8b():
    """Eight sequences of 8,192 tokens: the log-softmax kept for the loss is 4V bytes a
    token (33.6 GB), and its backward adds two dense fp32 gradients of the logits."""
    model = ModelSpec.from_arch(get_preset("llama3-8b"))
    p = peak(model, BF16, Workload(8 * 8192, 8192), 8, 1)
    assert p.head_activations >= 4 * 128256 * 8 * 8192
    assert round(p.head_activations / GB, 1) == 35.8  # 4V + the final norm's 8h + 4, + ids
    assert p.loss_backward == 8 * 128256 * 8 * 8192


def test_recommend_replays_the_llama3_8b_case():
    """Issue #19: 64 sequences of 8,192 tokens on 8 80-GB H100s. Before, the planner
    recommended ZeRO-1, checkpointing, 8 sequences per micro-batch at 71.04 GB against
    the 72 GB limit; with the loss path that configuration's peak is far above it, and
    every configuration recommend proposes fits its own peak."""
    model = ModelSpec.from_arch(get_preset("llama3-8b"))
    old = peak(model, BF16, Workload(8 * 8192, 8192, True), 8, 1, prefetch=0)
    assert old.bytes > 72 * GB + 36 * GB
    for flash in (False, True):
        rec = recommend(model, BF16, 8, 80 * GB, H100, 64, 8192, flash_attention=flash)
        for c in (rec.best, *rec.runners_up):
            work = Workload(c.micro_batch * 8192, 8192, c.checkpointing, flash)
            planned = peak(model, BF16, work, 8, c.stage, c.prefetch, c.blocks_per_unit, c.tp,
                           c.accumulation)
            assert c.memory == planned.bytes <= 72 * GB
        assert rec.best.micro_batch == 1
