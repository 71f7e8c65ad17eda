"""The page's planner port (``plan/page/planner.js``) held against the Python planner
without a browser: Node runs the script on the page's own data, and every preset's
activation bytes, under each of the page's checkpointing modes, with and without flash
attention, in two precisions and two shapes, must be Python's integer exactly (and a
bare count's, by the source documents' formula). Skipped where Node is not installed;
``test_page.py`` drives the whole page in a browser."""

from __future__ import annotations

import json
import shutil
import subprocess
from importlib.resources import files

import pytest

from zeroshard.plan import ModelSpec, Workload, get_recipe
from zeroshard.plan.arch import PRESETS
from zeroshard.plan.page import PAGE_CHECKPOINTING, page_data
from zeroshard.plan.workload import activation_bytes

NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="Node.js is not installed")

RECIPES = ("bf16-mixed-adamw", "fp32-adamw")
SHAPES = ((2048, None), (8192, 2048))  # (tokens, seq_len)
BARE = dict(hidden=4096, layers=32, heads=32)


def _cases() -> list[dict]:
    cases = []
    for name in [*PRESETS, None]:
        for mode in PAGE_CHECKPOINTING:
            for flash in (False, True):
                for recipe in RECIPES:
                    for tokens, seq in SHAPES:
                        cases.append(dict(preset=name, mode=mode, flash=flash, recipe=recipe,
                                          tokens=tokens, seq_len=seq))
    return cases


def _python(c: dict) -> int | None:
    if c["preset"] is None:
        model = ModelSpec("bare", 6_738_149_376, **BARE)
    else:
        model = ModelSpec.from_arch(PRESETS[c["preset"]])
    work = Workload.of_mode(c["tokens"], c["seq_len"], c["mode"], flash_attention=c["flash"])
    return activation_bytes(model, get_recipe(c["recipe"]), work)


_HARNESS = """
const DATA = %s;
%s
const cases = %s;
const out = cases.map((c) => {
  const p = c.preset === null ? null : DATA.presets[c.preset];
  const model = p === null ? { hidden: %d, layers: %d, heads: %d }
    : { hidden: p.hidden, layers: p.layers, heads: p.heads, arch: p };
  const work = { tokens: c.tokens, seq_len: c.seq_len, checkpointing: c.mode,
                 flash_attention: c.flash };
  const got = Planner.activationBytes(model, DATA.recipes[c.recipe], work);
  return got === null ? null : got.toString();
});
console.log(JSON.stringify(out));
"""


def test_the_page_computes_the_planners_activation_bytes(tmp_path):
    cases = _cases()
    planner = files("zeroshard.plan").joinpath("page", "planner.js").read_text()
    script = _HARNESS % (json.dumps(page_data()), planner, json.dumps(cases),
                         BARE["hidden"], BARE["layers"], BARE["heads"])
    (tmp_path / "check.js").write_text(script)
    run = subprocess.run([NODE, str(tmp_path / "check.js")], capture_output=True, text=True,
                         timeout=120, check=True)
    got = json.loads(run.stdout)
    wrong = [(c, g, _python(c)) for c, g in zip(cases, got)
             if (None if g is None else int(g)) != _python(c)]
    assert not wrong, wrong[:5]
    assert len(cases) == (len(PRESETS) + 1) * len(PAGE_CHECKPOINTING) * 2 * 2 * 2
