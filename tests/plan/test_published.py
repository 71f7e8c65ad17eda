"""The step-time model against published FSDP runs (``plan/published.py``): every row's
error as docs/steptime.md prints it, the median within 10 %, the worst row named."""

import re
from pathlib import Path

import pytest

from zeroshard.plan.hardware import ACCELERATORS
from zeroshard.plan.published import RUNS, median_abs_error, replay

DOC = Path(__file__).resolve().parents[2] / "docs" / "steptime.md"


@pytest.fixture(scope="module")
def rows():
    return replay()


def test_median_error_within_ten_percent(rows):
    assert len(rows) == len(RUNS) == 18
    assert median_abs_error(rows) <= 0.10
    assert f"**Median |error| {median_abs_error(rows) * 100:.1f} %**" in DOC.read_text()


def test_the_worst_row_is_the_one_named(rows):
    worst = max(rows, key=lambda r: abs(r.error))
    assert (worst.run.source, worst.run.model, worst.run.gpus) == ("torchtitan H100",
                                                                  "llama3-8b", 128)
    assert f"on 128 H100s, {worst.error * 100:+.1f} %**" in DOC.read_text()


def test_every_row_as_documented(rows):
    """docs/steptime.md's calibration table: measured, predicted and error per row."""
    table = [line for line in DOC.read_text().splitlines()
             if re.match(r"\| (torchtitan|IBM|LLM Foundry)", line)]
    assert len(table) == len(rows)
    for line, r in zip(table, rows):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == r.run.source and cells[1] == r.run.model
        assert cells[5] == f"{r.run.tokens_per_gpu:,.0f}"
        assert cells[6] == f"{r.predicted:,.0f}"
        assert cells[7] == f"{r.error * 100:+.1f} %"


def test_presets_hold_the_calibration():
    assert (ACCELERATORS["a100"].efficiency, ACCELERATORS["h100"].efficiency) == (0.59, 0.44)
    assert ACCELERATORS["h200"].efficiency == ACCELERATORS["h100"].efficiency
    assert all(ACCELERATORS[a].recompute_charge == 0.25 for a in ("a100", "h100", "h200"))
    assert ACCELERATORS["cpu"].recompute_charge == 1.0


def test_recompute_is_charged_apart():
    """Compute = A·(3 + charge/k)·forward: the model FLOPs at the efficiency, the
    recomputed forward of every k-th block at ``recompute_charge`` of its count."""
    from zeroshard.plan import (
        Accelerator,
        Cluster,
        ModelSpec,
        ParallelDims,
        Schedule,
        Workload,
        ZeroConfig,
        get_network,
        get_recipe,
        step_time,
    )
    from zeroshard.plan.steptime import train_flops_per_token

    model = ModelSpec("m", 10**9, hidden=2048, layers=16, heads=16)
    acc = Accelerator("toy", 1e15, 1e12, efficiency=0.5, recompute_charge=0.25)
    cluster = Cluster(acc, get_network("nvlink4-ndr"))
    on8, bf16 = ParallelDims(8), ZeroConfig(mixed_precision=get_recipe("bf16-mixed-adamw"))
    fwd = train_flops_per_token(model, 4096, False) / 3 * 8192 / (1e15 * 0.5)
    for every, share in ((1, 1.0), (2, 0.5), (4, 0.25)):
        work = Workload(8192, 4096, True, True, every)
        t = step_time(model, on8, bf16, work, cluster, Schedule(micro_batches=2))
        assert t.compute == pytest.approx(2 * (3 + 0.25 * share) * fwd)
    plain = step_time(model, on8, bf16, Workload(8192, 4096, False), cluster)
    assert plain.compute == pytest.approx(3 * fwd)
    with pytest.raises(ValueError, match="recompute_charge=1.5 must be in"):
        Accelerator("x", 1e12, 1e12, recompute_charge=1.5)
