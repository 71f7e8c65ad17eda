"""The planner: memory per GPU by category, communication and step time per step,
and a recommended configuration, before a run.

Pure Python — importing this package never imports torch. Every function takes the
configuration the engine runs (a ``ZeroConfig``) and the layout it runs on (a
``ParallelDims``), beside the model and the workload ([Note: planner inputs] in
``layout.py``); ``plan_all`` shows each stage with what it takes of the configuration:

>>> from zeroshard.plan import ModelSpec, ParallelDims, ZeroConfig, plan_all
>>> model = ModelSpec("7B-style", 6_738_149_376, hidden=4096, layers=32)
>>> plans = plan_all(model, ParallelDims(8), ZeroConfig(mixed_precision="bf16"))
>>> [round(p.total / 1e9, 2) for p in plans]
[108.63, 37.88, 26.09, 14.3]
"""

from ..spec.config import PLANNED_DISK, ZeroConfig
from ..spec.dims import ParallelDims
from ..spec.recipes import DEFAULT_RECIPE, DTYPE_BYTES, RECIPES, Recipe, get_recipe
from .advice import MinGpus, first_fit, floor_bytes, min_gpus, offload_offer, why_none_fits
from .arch import PRESETS, Architecture, ModelSpec, get_preset
from .hardware import (
    ACCELERATORS,
    HOSTS,
    NETWORKS,
    Accelerator,
    Cluster,
    Host,
    Link,
    Network,
    get_accelerator,
    get_host,
    get_network,
)
from .hfconfig import from_hf_config
from .layout import check_layout, stages_taking
from .memory import (
    STRATEGIES,
    StrategyPlan,
    Workload,
    activation_bytes,
    comm_bytes,
    comm_bytes_by_level,
    model_state_bytes,
    plan_all,
    plan_strategy,
    ring_all_reduce,
    ring_one_way,
    shard_degree,
    stage_of,
)
from .placement import OFFLOADS, Placement, pcie_bytes, placed_bytes
from .recommend import Recommendation, recommend
from .steptime import Schedule, StepTime, step_time, step_times

__all__ = [
    "ACCELERATORS", "Accelerator", "Cluster", "Link", "NETWORKS", "Network", "Recommendation",
    "Schedule", "StepTime", "get_accelerator", "get_network", "recommend", "step_time",
    "step_times",
    "Architecture", "DEFAULT_RECIPE", "DTYPE_BYTES", "MinGpus", "ModelSpec", "PRESETS",
    "RECIPES", "Recipe", "STRATEGIES", "StrategyPlan", "Workload", "activation_bytes",
    "comm_bytes", "comm_bytes_by_level", "first_fit", "floor_bytes", "from_hf_config",
    "get_preset", "get_recipe",
    "min_gpus", "model_state_bytes", "plan_all", "plan_strategy", "ring_all_reduce",
    "ring_one_way", "shard_degree", "stage_of", "why_none_fits",
    "HOSTS", "Host", "OFFLOADS", "Placement", "get_host", "offload_offer", "pcie_bytes",
    "placed_bytes", "PLANNED_DISK", "ParallelDims", "ZeroConfig", "check_layout",
    "stages_taking",
]
