"""The page's four "predict, then check" exercises (first source document, section 2):
each answer the page reveals equals what the Python planner computes, under the
page's current recipe, workload and unit."""

from __future__ import annotations

import json

import pytest

from zeroshard.plan import (
    PRESETS,
    ModelSpec,
    ParallelDims,
    Workload,
    ZeroConfig,
    first_fit,
    floor_bytes,
    get_recipe,
    min_gpus,
    plan_all,
    plan_strategy,
)
from zeroshard.plan.page import page_mode

from .page_browser import UNITS, model_of, set_controls

STATES = [
    dict(mode="preset", preset="llama2-7b", gpus=8, mem=80, unit="GB",
         recipe="bf16-mixed-adamw", tokens=2048, checkpointing=True),
    dict(mode="preset", preset="mistral-7b", gpus=64, mem=48, unit="GiB",
         recipe="fp32-adamw", tokens=4096, checkpointing=False, flash=True, step=8),
    dict(mode="params", params=13_000_000_000, gpus=16, mem=24, unit="GB",
         recipe="bf16-mixed-adamw-fp32-grads", tokens=1024, checkpointing=True),
]


def answers(c: dict) -> dict[int, dict]:
    """The four answers, from the Python planner."""
    unit, recipe = UNITS[c["unit"]], get_recipe(c["recipe"])

    def config(stage, name=None):  # the page's recipe, taken whole
        return ZeroConfig(stage=stage, mixed_precision=get_recipe(name) if name else recipe)

    work = Workload.of_mode(c["tokens"], c.get("seq_len"), page_mode(c["checkpointing"]),
                            flash_attention=c.get("flash", False))
    model = model_of(c)
    budget = int(c["mem"] * unit)
    m7, m70 = (ModelSpec.from_arch(PRESETS[n]) for n in ("llama2-7b", "llama2-70b"))
    fits = [first_fit(plan_all(m7, ParallelDims(8), config(3), work, int(g * unit))) or "none"
            for g in (80, 24)]

    def z1(n):
        return plan_strategy(model, ParallelDims(n), config(1), work=work).total

    knee = next((n for n in (8, 16, 32, 64, 128, 256) if z1(n) - z1(2 * n) < unit), None)
    need = min_gpus(m70, config(3), int(80 * unit), work, c.get("step"))
    ddp = {r: plan_strategy(model, ParallelDims(c["gpus"]), config(0, r), work, budget)
           for r in ("bf16-mixed-adamw", "fp32-adamw")}

    def cmp(field):
        a, b = (getattr(ddp[r], field) for r in ("bf16-mixed-adamw", "fp32-adamw"))
        return "grows" if b > a else "shrinks" if b < a else "stays the same"

    z1_floor = floor_bytes(model, config(1))
    return {
        1: {"fit80": fits[0], "fit24": fits[1]},
        2: {"knee": str(knee) if knee else "never", "floor": "weights + grads (+ activations)",
            "_bytes": [str(z1(8)), str(z1(256)), str(z1_floor)]},
        3: {"gpus": str(need.gpus) if need.gpus else "never"},
        4: {"optimizer": cmp("optimizer"), "total": cmp("total")},
    }


@pytest.mark.parametrize("state", STATES, ids=["default", "fp32-no-ckpt-gib", "bare-13b"])
def test_exercises_match_planner(session, state):
    page = session.page
    set_controls(page, state)
    want = answers(state)
    for n, values in want.items():
        graded = {k: v for k, v in values.items() if not k.startswith("_")}
        for i, (key, value) in enumerate(graded.items()):
            # the first prediction right, the second (if any) deliberately blank
            if i == 0:
                page.locator(f"#ex{n}-{key}").fill(value) if n == 3 else page.select_option(
                    f"#ex{n}-{key}", value)
        page.click(f"#ex{n}-check")
        out = page.locator(f'[data-exercise="{n}"] output')
        got = json.loads(out.get_attribute("data-answer"))
        assert got["values"] == graded, n
        if "_bytes" in values:
            assert got["bytes"] == values["_bytes"]
        marks = out.locator(".marks").inner_text()
        assert marks.startswith(f"✓ {next(iter(graded.values()))}"), marks
        assert "Why:" in out.inner_text()
    assert session.errors == [] and session.network == []


def test_show_it_moves_the_controls(session):
    page = session.page
    page.click('[data-exercise="3"] .show')
    assert page.input_value("#preset") == "llama2-70b"
    assert page.input_value("#gpus") == "16" and page.input_value("#gpu-mem") == "80"
    page.click('[data-exercise="4"] .show')
    assert page.input_value("#recipe") == "fp32-adamw"
    assert page.input_value("#preset") == "llama2-70b"  # the model stays
    assert session.errors == []
