"""The planner page in a real browser: Debian's chromium, driven by Playwright.

Each configuration is set through the page's own controls (the same clicks, keys and
typing a person would use), then every readout cell, bar segment, fewest-GPU result,
sweep point and floor is compared, as an exact integer and as printed text, with
``zeroshard plan``'s Python functions. The page must make no network request.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from zeroshard.plan import (
    PRESETS,
    RECIPES,
    STRATEGIES,
    Architecture,
    ModelSpec,
    ParallelDims,
    Workload,
    ZeroConfig,
    first_fit,
    floor_bytes,
    get_recipe,
    min_gpus,
    offload_offer,
    plan_all,
    why_none_fits,
)
from zeroshard.plan.page import page_mode, write_page
from zeroshard.plan.render import _fmt

from . import page_browser
from .page_browser import (
    CONFIGS,
    READ,
    UNITS,
    Session,
    model_of,
    need_browser,
    set_controls,
)

SWEEP = [1 << k for k in range(11)]


def config(recipe, stage: int = 3, **options) -> ZeroConfig:
    """The page's configuration: its recipe taken whole (reduced in its own dtype)."""
    return ZeroConfig(stage=stage, mixed_precision=recipe, **options)


def exact(value) -> str:
    """How the page writes a byte count in data-bytes: the integer, or empty for None."""
    return "" if value is None else str(value)


def expected(c: dict) -> dict:
    """What ``zeroshard plan`` computes for configuration ``c``."""
    model, unit = model_of(c), UNITS[c["unit"]]
    recipe = get_recipe(c["recipe"])
    work = Workload.of_mode(c["tokens"], c.get("seq_len"), page_mode(c["checkpointing"]),
                            flash_attention=c.get("flash", False))
    budget = int(c["mem"] * unit)  # command.run
    gpus, group = c["gpus"], c.get("shard_group")
    plans = plan_all(model, ParallelDims(gpus, shard=group), config(recipe), work, budget)
    mins = [min_gpus(model, config(recipe, s), budget, work, c.get("step"))
            for s in range(len(STRATEGIES))]
    return dict(model=model, unit=unit, recipe=recipe, work=work,
                budget=budget, gpus=gpus, plans=plans, mins=mins, fit=first_fit(plans),
                group=group)


def check_readout(got: dict, want: dict) -> None:
    unit, plans = want["unit"], want["plans"]
    assert got["status"] == "" and got["gpus"] == str(want["gpus"])
    assert got["params"] == str(want["model"].params)
    assert got["budget"] == str(want["budget"])
    assert got["first"] == (want["fit"] or "")
    group = want.get("group")
    if want["fit"] is None:
        dims, recipe = ParallelDims(want["gpus"], shard=group), config(want["recipe"])
        why = why_none_fits(want["model"], dims, recipe, want["budget"], want["work"])
        assert got["headline"] == why
        offer = offload_offer(want["model"], dims, recipe, want["budget"], want["work"],
                              unit=unit, unit_name="GiB" if unit == 2**30 else "GB")
        assert got["offload"] == (offer or "")
    else:
        assert got["offload"] == ""
        assert got["headline"].startswith(f"first fit on {want['gpus']} GPUs: {want['fit']}")
    ddp = plans[0].comm
    levels = (("comm_inside", 2), ("comm_across", 2)) if group is not None else ()
    for p in plans:
        row = got["plan"][p.strategy]
        assert set(row) == {"weights", "grads", "optimizer", "activations", "total", "comm",
                            "ratio", "fits", *(f for f, _ in levels)}
        for field, decimals in (("weights", 2), ("grads", 2), ("optimizer", 2),
                                ("activations", 3), ("total", 2), ("comm", 2), *levels):
            value = getattr(p, field)
            assert row[field]["bytes"] == exact(value), (p.strategy, field)
            assert row[field]["text"] == _fmt(value, unit, decimals), (p.strategy, field)
        assert row["ratio"]["text"] == (f"{p.comm / ddp:.2f}x" if ddp else "n/a")
        assert row["fits"]["text"] == ("yes" if p.fits else "no")
    for m in want["mins"]:
        row = got["mins"][m.strategy]
        assert row["gpus"]["gpus"] == exact(m.gpus), m
        assert row["total"]["bytes"] == exact(m.total), m
        assert row["floor"]["bytes"] == str(m.floor), m
        assert row["floor"]["text"] == _fmt(m.floor, unit, 1)
    bars = {(s, cat): b for s, cat, b in got["bars"]}
    assert len(bars) == 16
    for p in plans:
        for cat in ("weights", "grads", "optimizer", "activations"):
            assert bars[p.strategy, cat] == exact(getattr(p, cat))
    model, recipe, work, budget = (want[k] for k in ("model", "recipe", "work", "budget"))
    assert [n for n, _ in got["sweep"]] == SWEEP
    for n, totals in got["sweep"]:
        assert totals == [str(p.total) for p in plan_all(model, ParallelDims(n), config(recipe),
                                                         work, budget)], n
    assert got["floors"] == {STRATEGIES[s]: str(floor_bytes(model, config(recipe, s)))
                             for s in (1, 2)}


@pytest.mark.parametrize("config", CONFIGS, ids=[c["id"] for c in CONFIGS])
def test_readout_matches_planner(session, config):
    set_controls(session.page, config)
    check_readout(session.page.evaluate(READ), expected(config))
    assert session.errors == []


def test_seed_worked_example_as_printed(session):
    """The first source document's 7B-style table, read off the page as text."""
    c = dict(mode="params", params=6_738_149_376, hidden=4096, layers=32, gpus=8, mem=80,
             unit="GB", recipe="bf16-mixed-adamw", tokens=2048, checkpointing=True)
    set_controls(session.page, c)
    got = session.page.evaluate(READ)
    assert [got["plan"][s]["total"]["text"] for s in STRATEGIES] == [
        "108.63", "37.88", "26.09", "14.30"]
    assert [got["plan"][s]["ratio"]["text"] for s in STRATEGIES] == ["1.00x"] * 3 + ["1.50x"]
    assert got["first"] == "ZeRO-1"


def test_architecture_port_counts_every_preset(session):
    counts = session.page.evaluate(
        "() => Object.fromEntries(Object.entries(DATA.presets).map("
        "([n, p]) => [n, String(Planner.archParams(p))]))")
    assert counts == {name: str(a.params) for name, a in PRESETS.items()}


def test_controls_are_labelled_and_reachable_by_keyboard(session):
    """Real form elements, each with a label; Tab walks into them from the top."""
    unlabelled = session.page.evaluate(
        "() => [...document.querySelectorAll('input, select')]"
        ".filter((e) => !e.labels.length && !e.getAttribute('aria-label'))"
        ".map((e) => e.id)")
    assert unlabelled == []
    page = session.page
    page.click("h1")  # Tab navigation starts from the heading
    page.keyboard.press("Tab")
    first = page.evaluate("() => document.activeElement.id")
    assert first.startswith("mode-")  # the model radios come first


def test_bad_input_is_reported_not_thrown(session):
    page = session.page
    page.fill("#tokens", "0")
    assert page.inner_text("#status") == "tokens must be a positive integer"
    page.fill("#tokens", "2048")
    assert page.inner_text("#status") == ""
    assert session.errors == []


def test_initial_state_from_python(browser, tmp_path):
    """write_page's state (as `zeroshard plan --html` passes it) is what the page opens with."""
    model = ModelSpec("from-config", 13_000_000_000, 5120, 40, 40)
    recipe = get_recipe("bf16-mixed-adamw").with_reduce_dtype("fp32")
    path = write_page(tmp_path / "plan.html", model=model, gpus=16, gpu_mem=24.5, gib=True,
                      recipe=recipe, tokens=4096, seq_len=2048, checkpointing=False,
                      flash_attention=False, gpu_step=8)
    s = Session(browser, path)
    c = dict(gpus=16, mem=24.5, unit="GiB", tokens=4096, seq_len=2048, checkpointing=False,
             step=8)
    work = Workload(4096, 2048, False, False)
    budget = int(24.5 * 2**30)
    plans = plan_all(model, ParallelDims(16), config(recipe), work, budget)
    want = dict(model=model, unit=2**30, recipe=recipe, work=work, budget=budget, gpus=16,
                plans=plans, fit=first_fit(plans),
                mins=[min_gpus(model, config(recipe, x), budget, work, c["step"])
                      for x in range(len(STRATEGIES))])
    check_readout(s.page.evaluate(READ), want)
    assert s.page.inner_text("#model-summary").startswith("from-config: P = 13,000,000,000")
    assert s.network == [] and s.errors == []
    s.context.close()
    dims = Architecture("custom", 2048, 24, 16, 5632, 32000, kv_heads=4, tied=True)
    s = Session(browser, write_page(tmp_path / "dims.html", model=dims, recipe="fp32-adamw"))
    assert s.page.is_checked("#mode-dims")
    assert s.page.evaluate(READ)["params"] == str(dims.params)
    s.context.close()


def test_plan_command_writes_the_page(browser, tmp_path, capsys):
    """`zeroshard plan --html` opens on the command line's settings, with the same numbers."""
    from zeroshard.cli import main

    path = tmp_path / "cli.html"
    assert main(["plan", "--model", "llama2-70b", "--gpus", "64", "--gpu-mem", "141",
                 "--precision", "fp32-adamw", "--html", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().err
    s = Session(browser, path)
    model, recipe, work = ModelSpec.from_arch(PRESETS["llama2-70b"]), get_recipe("fp32-adamw"), \
        Workload(2048)
    budget = 141 * 10**9
    plans = plan_all(model, ParallelDims(64), config(recipe), work, budget)
    want = dict(model=model, unit=10**9, recipe=recipe, work=work, budget=budget, gpus=64,
                plans=plans, fit=first_fit(plans),
                mins=[min_gpus(model, config(recipe, x), budget, work)
                      for x in range(len(STRATEGIES))])
    check_readout(s.page.evaluate(READ), want)
    assert s.network == [] and s.errors == []
    s.context.close()
    assert main(["plan", "--tp", "2", "--html", str(tmp_path / "tp.html")]) == 2
    assert "drop --tp=2" in capsys.readouterr().err and not (tmp_path / "tp.html").exists()


def test_a_shard_group_that_does_not_divide_is_reported(session):
    from zeroshard.plan.memory import shard_degree

    page = session.page
    page.fill("#gpus", "8")
    page.fill("#shard-group", "3")
    with pytest.raises(ValueError) as python:
        shard_degree(8, 1, 3)
    assert page.inner_text("#status") == str(python.value)
    page.fill("#shard-group", "")
    assert page.inner_text("#status") == "" and session.errors == []


def test_plan_command_writes_a_hybrid_page(browser, tmp_path, capsys):
    """`zeroshard plan --shard-group node --html`: the page opens in groups of a node."""
    from zeroshard.cli import main

    path = tmp_path / "hybrid.html"
    assert main(["plan", "--model", "llama2-13b", "--gpus", "256", "--shard-group", "node",
                 "--html", str(path)]) == 0
    capsys.readouterr()
    s = Session(browser, path)
    assert s.page.input_value("#shard-group") == "8"
    c = dict(mode="preset", preset="llama2-13b", gpus=256, mem=80, unit="GB",
             recipe="bf16-mixed-adamw", tokens=2048, checkpointing=True, shard_group=8)
    check_readout(s.page.evaluate(READ), expected(c))
    assert s.network == [] and s.errors == []
    s.context.close()


@pytest.mark.parametrize("state,message", [
    (dict(gpus=2048), "runs from 1 to 1,024"), (dict(tp=2), "data parallelism alone"),
    (dict(model="nope"), "unknown model 'nope'"), (dict(tokens=0), "must be a positive"),
    (dict(gpus=8, shard_group=3), "shard_group=3 gives shard groups of 3 ranks, which do not "
                                  "divide the 8"),
])
def test_write_page_refuses_a_state_it_cannot_show(tmp_path, state, message):
    with pytest.raises(ValueError, match=message):
        write_page(tmp_path / "plan.html", **state)


def test_missing_browser_skips_unless_required(monkeypatch):
    monkeypatch.setattr(page_browser, "CHROMIUM", "/nonexistent/chromium")
    monkeypatch.delenv("ZEROSHARD_REQUIRE_BROWSER", raising=False)
    with pytest.raises(pytest.skip.Exception, match="is missing"):
        need_browser()
    monkeypatch.setenv("ZEROSHARD_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="ZEROSHARD_REQUIRE_BROWSER=1 but"):
        need_browser()


def _save(page, name: str, tmp_path: Path) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    out = os.environ.get("ZEROSHARD_SCREENSHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(out) / name)
    return path


def test_screenshots_wide_and_narrow(browser, tmp_path):
    """The planner page's pictures (docs/plan.md): the default plan, wide and at 360 px."""
    page_file = write_page(tmp_path / "plan.html")
    for width, name in ((1600, "planner-page.png"), (360, "planner-page-narrow.png")):
        s = Session(browser, page_file, width)
        s.page.click("#ex1-check")
        overflow = s.page.evaluate("() => document.documentElement.scrollWidth")
        assert overflow <= width, f"the page is {overflow} px wide at {width} px"
        png = _save(s.page, name, tmp_path)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert s.network == [] and s.errors == []
        s.context.close()


def test_no_network_requests(session):
    """Runs last in this module: everything the page did was local."""
    assert session.requests and session.network == []
    html = Path(session.page.url.removeprefix("file://")).read_text()
    assert "<script src" not in html and "<link" not in html
    assert json.loads(session.page.evaluate("() => JSON.stringify(DATA.strategies)")) == list(
        STRATEGIES)
    assert set(session.page.evaluate("() => Object.keys(DATA.recipes)")) == set(RECIPES)

