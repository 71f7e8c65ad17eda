"""The planner as one self-contained HTML page (``zeroshard plan --html FILE``).

The page reproduces the first source document's visualization (section 2): stacked
bars per strategy against a memory budget, a GPU-count slider, a model, GPU-memory and
precision choice, a readout, a sweep over GPU counts, and its four "predict, then
check" exercises. Everything is inlined (styles, scripts, data), so the file opens from
disk with no network access.

The page never holds a second copy of the planner's numbers: presets, recipes,
strategies and the search limit are dumped here from the Python definitions, and so is
what each stage means (``policies``: ``ShardPolicy.as_dict`` per stage, and the stages
each offload takes), which the scripts read instead of comparing stage numbers; the
formulas in ``page/planner.js`` mirror :mod:`.state`, :mod:`.comm`, :mod:`.memory` and
:mod:`.advice` function by function (``tests/plan/test_page.py`` drives the page in a
browser and compares exactly).
"""

from __future__ import annotations

import dataclasses
import json
from importlib.resources import files
from pathlib import Path

from ..spec.config import ZeroConfig
from ..spec.policy import ShardPolicy
from ..spec.recipes import DEFAULT_RECIPE, RECIPES, Recipe, get_recipe
from ..spec.rules import OFFLOADS
from .advice import MAX_GPUS
from .arch import PRESETS, Architecture, ModelSpec
from .hardware import DEFAULT_HOST, HOSTS, Host
from .layout import takes_all
from .memory import STRATEGIES, Workload, shard_degree

#: GPU memory choices offered on the page, in GB (24 GB consumer cards to 141 GB H200).
GPU_MEMORY_GB = (24, 40, 48, 80, 141)

#: Scripts inlined in this order: data first, the planner port, then what draws it.
SCRIPTS = ("format.js", "planner.js", "offload.js", "readout.js", "charts.js", "exercises.js",
           "app.js")

DEFAULT_MODEL = "llama2-7b"


def _asset(name: str) -> str:
    return files(__package__).joinpath("page", name).read_text(encoding="utf-8")


def _recipe_data(recipe: Recipe) -> dict:
    """The bytes per parameter the formulas use, as the Recipe properties compute them."""
    fields = ("weight_bytes", "grad_bytes", "optimizer_bytes", "master_bytes",
              "reduce_bytes", "activation_bytes", "total_bytes")
    return {"name": recipe.name, **{f: getattr(recipe, f) for f in fields},
            "optimizer_states": recipe.optimizer_states}


def _host_data(host: Host) -> dict:
    """The host side advice.offload_offer prices offload with, nodes of 8 GPUs."""
    return {"pcie_name": host.pcie.name, "pcie_bandwidth": host.pcie.bandwidth,
            "memory_bandwidth": host.memory_bandwidth, "gpus_per_node": 8}


def _policy_data() -> dict:
    """What each stage means, for the scripts: its policy (``ShardPolicy.as_dict``:
    which categories it shards, its reduction, what follows the step), and per offload
    the stages that take it (``spec/rules.py``)."""
    stages = range(len(STRATEGIES))
    return {"policies": [ShardPolicy.for_stage(s).as_dict() for s in stages],
            "offload_stages": {o: [s for s in stages if takes_all(s, ZeroConfig(offload=o))]
                               for o in OFFLOADS}}


def _recipe_key(recipe: Recipe) -> str:
    """The name the page lists a recipe under; a known recipe reduced in another dtype
    gets a name of its own."""
    known = RECIPES.get(recipe.name)
    if known is None or known == recipe:
        return recipe.name
    return f"{recipe.name}, reduced in {recipe.reduce_dtype}"


def _preset_data(arch: Architecture) -> dict:
    """A preset's dimensions and its ModelSpec; the count travels as a string so the
    page's BigInt arithmetic reads it exactly."""
    spec = ModelSpec.from_arch(arch)
    return {**dataclasses.asdict(arch), "params": str(spec.params)}


def _llama_style(arch: Architecture) -> bool:
    """What the page's dimension fields describe (command.resolve_model's dimensions)."""
    return (arch.gated_mlp and not arch.norm_bias and not arch.linear_bias
            and arch.max_positions == 0 and arch.head_dim is None)


def _model_state(model: ModelSpec | Architecture | str | None) -> dict:
    """How the page's model controls start: a preset, or a bare parameter count with
    the shape the activation model needs."""
    if model is None:
        model = DEFAULT_MODEL
    if isinstance(model, str):
        if model not in PRESETS:
            raise ValueError(f"unknown model {model!r}; known models: {', '.join(PRESETS)}")
        return {"mode": "preset", "preset": model}
    if isinstance(model, Architecture):
        if PRESETS.get(model.name) == model:
            return {"mode": "preset", "preset": model.name}
        if _llama_style(model):
            return {"mode": "dims", "dims": dataclasses.asdict(model)}
        model = ModelSpec.from_arch(model)
    preset = PRESETS.get(model.name)
    if preset is not None and ModelSpec.from_arch(preset) == model:
        return {"mode": "preset", "preset": model.name}
    return {"mode": "params", "name": model.name, "params": str(model.params),
            "hidden": model.hidden, "layers": model.layers, "heads": model.heads}


#: The page's activation checkpointing choices (a device's: offload keeps nothing there).
PAGE_CHECKPOINTING = ("none", "full", "selective", "full+offload")


def page_mode(checkpointing: bool | str) -> str:
    """The page's checkpointing: True is "full", False "none", else one of
    :data:`PAGE_CHECKPOINTING` (every k-th block is ``zeroshard plan``'s alone)."""
    if checkpointing is True or checkpointing is False:
        return "full" if checkpointing else "none"
    if checkpointing not in PAGE_CHECKPOINTING:
        raise ValueError(f"checkpointing={checkpointing!r}: the page offers "
                         f"{', '.join(map(repr, PAGE_CHECKPOINTING))}")
    return checkpointing


def page_data(model=None, gpus: int = 8, gpu_mem: float = 80.0, gib: bool = False,
              recipe: str | Recipe = DEFAULT_RECIPE, tokens: int = 2048,
              seq_len: int | None = None, checkpointing: bool | str = True,
              flash_attention: bool = False, gpu_step: int | None = None,
              tp: int = 1, shard_group: int | None = None) -> dict:
    """Everything the page's scripts read: the planner's definitions and the initial
    state of the controls (the same meaning as ``zeroshard plan``'s flags)."""
    if tp != 1:
        raise ValueError(f"tp={tp}: the page plans data parallelism alone (tp = 1)")
    if not isinstance(gpus, int) or not 1 <= gpus <= 1024:
        raise ValueError(f"gpus={gpus!r}: the page's GPU count runs from 1 to 1,024")
    if gpu_mem <= 0:
        raise ValueError(f"gpu_mem={gpu_mem!r} must be positive")
    if gpu_step is not None and gpu_step <= 0:
        raise ValueError(f"gpu_step={gpu_step!r} must be positive")
    shard_degree(gpus, 1, shard_group)  # validates the group: it divides the GPUs
    checkpointing = page_mode(checkpointing)
    Workload.of_mode(tokens, seq_len, checkpointing,
                     flash_attention=flash_attention)  # validates the workload
    recipe = get_recipe(recipe)
    recipes = {name: _recipe_data(r) for name, r in RECIPES.items()}
    recipes.setdefault(_recipe_key(recipe), _recipe_data(recipe))
    return {
        "strategies": list(STRATEGIES),
        **_policy_data(),
        "max_gpus": MAX_GPUS,
        "gpu_memory_gb": list(GPU_MEMORY_GB),
        "default_recipe": DEFAULT_RECIPE,
        "presets": {name: _preset_data(a) for name, a in PRESETS.items()},
        "recipes": recipes,
        "host": _host_data(HOSTS[DEFAULT_HOST]),
        "initial": {
            "model": _model_state(model), "gpus": gpus, "gpu_mem": gpu_mem,
            "unit": "GiB" if gib else "GB", "recipe": _recipe_key(recipe), "tokens": tokens,
            "seq_len": seq_len, "checkpointing": checkpointing,
            "flash_attention": flash_attention, "gpu_step": gpu_step,
            "shard_group": shard_group,
        },
    }


def _inline_json(data: dict) -> str:
    # "</" would end the <script> element early; "<\/" is the same JSON string.
    return json.dumps(data, separators=(",", ":")).replace("</", "<\\/")


def render_page(**state) -> str:
    """The page's HTML with styles, data and scripts inlined; ``state`` as for
    :func:`page_data`."""
    data = f"const DATA = {_inline_json(page_data(**state))};"
    scripts = "\n".join([data, *(_asset(name) for name in SCRIPTS)])
    if "</script" in scripts.lower():
        raise AssertionError("a page script contains '</script'")
    html = _asset("page.html")
    return html.replace("/*STYLE*/", _asset("page.css")).replace("/*SCRIPT*/", scripts)


def write_page(path: str | Path, **state) -> Path:
    """Write the page to ``path`` and return it.

    ``state`` sets the controls the page opens with: ``model`` (a preset name, an
    :class:`Architecture` or a :class:`ModelSpec`), ``gpus``, ``gpu_mem`` (GB, or GiB
    with ``gib=True``), ``recipe`` (a name, ``W/G/O`` or a :class:`Recipe`), ``tokens``,
    ``seq_len``, ``checkpointing`` (True, False or a mode of
    :data:`PAGE_CHECKPOINTING`), ``flash_attention``, ``gpu_step`` (None: the
    fewest-GPU search tries powers of two) and ``shard_group`` (hybrid sharding's group
    size; None: plain). ``tp`` must be 1: the page has no tensor
    parallelism.

    The only address in the page is the SVG namespace's name, which is never fetched:

    >>> import os, re, tempfile
    >>> out = write_page(os.path.join(tempfile.mkdtemp(), "plan.html"), model="gpt2")
    >>> sorted(set(re.findall(r"[a-z]+://[a-z0-9./-]*", out.read_text())))
    ['http://www.w3.org/2000/svg']
    """
    path = Path(path)
    path.write_text(render_page(**state), encoding="utf-8")
    return path
