"""``ZeroConfig``: what ``zs.shard`` does, validated once at construction."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .._jsonfile import read_json_object
from ..plan.recipes import RECIPES, Recipe, get_recipe

#: ``mixed_precision`` shorthands -> recipe names.
_PRECISION = {None: "fp32-adamw", "fp32": "fp32-adamw", "bf16": "bf16-mixed-adamw",
              "fp16": "fp16-mixed-adamw"}


@dataclass(frozen=True)
class ZeroConfig:
    """Configuration of a sharded model."""

    stage: int = 3
    """ZeRO stage: 0 (DDP), 1 (+ optimizer state sharded), 2 (+ gradients), 3 (+ params)."""
    mixed_precision: str | None = None
    """None or "fp32": fp32 weights, no master copy (4/4/8 bytes per parameter).
    "bf16": bf16 compute weights and gradients, fp32 master and optimizer state
    (2/2/12). A recipe name from ``zeroshard.plan.RECIPES`` is also accepted."""
    reduce_dtype: str | None = None
    """Dtype gradients are summed in across ranks; None: fp32 under mixed precision
    (one rounding into the stored dtype instead of one per rank), else the gradient
    dtype."""
    units: Any = "blocks"
    """Unit policy (see ``zeroshard.runtime.units.select_units``): "blocks", None,
    module classes, a list of modules, or a parameter count."""
    param_persistence_threshold: int = 0
    """Stage 3: parameters with fewer elements than this stay whole on every rank
    between uses, in one unit that is never released (DeepSpeed's
    ``stage3_param_persistence_threshold``): biases and norms skip the gathers, at the
    price of their full weights on every rank; their gradients and optimizer state stay
    sharded. 0 shards every parameter."""
    prefetch: int = 1
    """Stage 3: units whose all-gather is issued ahead of use, in the order recorded on
    the previous pass (forward, and reversed in backward), so it overlaps the current
    unit's compute. Each prefetched unit adds its full parameters to the peak; 0 gathers
    only on use."""
    prefetch_bucket_size: int = 0
    """Stage 3: if > 0, the units prefetched at once hold at most this many elements
    (DeepSpeed's ``stage3_prefetch_bucket_size``); the next unit is always allowed."""
    reduce_bucket_size: int = 0
    """If > 0, the gradient reductions of consecutive units share one collective until
    it holds at least this many elements (DeepSpeed's ``reduce_bucket_size``): fewer,
    larger collectives for models of many small units, at the cost of a larger
    communication buffer. 0: one reduction per unit."""
    profile: bool = False
    """Record a timeline of unit lifecycle events with bytes per category, activation
    bytes (saved-tensor hooks) and a collective trace (``model.profiler``). Off, the
    engine pays one attribute check per event."""
    sync_module_states: bool = True
    """Broadcast rank 0's parameters and buffers at shard time, so every rank starts
    from the same weights whatever its seed."""
    recipe: Recipe = field(init=False)
    """The precision recipe resolved from ``mixed_precision`` and ``reduce_dtype``:
    the same definition the planner computes bytes from."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3) or isinstance(self.stage, bool):
            raise ValueError(f"stage={self.stage!r} is not a ZeRO stage; expected 0, 1, 2 or 3")
        name = _PRECISION.get(self.mixed_precision, self.mixed_precision)
        if name not in RECIPES:
            raise ValueError(
                f"mixed_precision={self.mixed_precision!r} is not supported; expected None, "
                f"'fp32', 'bf16' or a recipe name ({', '.join(RECIPES)})")
        recipe = get_recipe(name)
        if recipe.param_dtype == "fp16":
            raise NotImplementedError(
                "fp16 compute needs dynamic loss scaling, which zeroshard does not implement; "
                "use mixed_precision='bf16'")
        reduce = self.reduce_dtype
        if reduce is None:
            reduce = "fp32" if recipe.master_dtype else recipe.grad_dtype
        for name in ("param_persistence_threshold", "prefetch", "prefetch_bucket_size",
                     "reduce_bucket_size"):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"{name}={t!r} must be an integer >= 0")
        if reduce not in ("fp32", "bf16"):
            raise ValueError(f"reduce_dtype={self.reduce_dtype!r}; expected 'fp32' or 'bf16'")
        object.__setattr__(self, "recipe", recipe.with_reduce_dtype(reduce))

    @classmethod
    def from_dict(cls, d: dict) -> ZeroConfig:
        """Our own keys (the field names), or a DeepSpeed config (``zero_optimization``)."""
        if "zero_optimization" in d or "bf16" in d:
            return cls.from_deepspeed(d)
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ZeroConfig keys {unknown}; expected some of {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_deepspeed(cls, d: dict) -> ZeroConfig:
        """The DeepSpeed keys zeroshard honours; every other key is named in one warning."""
        zero = d.get("zero_optimization", {})
        stage = zero.get("stage", 0)
        persist = zero.get("stage3_param_persistence_threshold", 0)
        prefetch = zero.get("stage3_prefetch_bucket_size", 0)
        bucket = zero.get("reduce_bucket_size", 0)
        bf16 = d.get("bf16", {}).get("enabled", False)
        if not isinstance(bf16, bool):
            raise ValueError(f"bf16.enabled={bf16!r} must be true or false")
        ignored = sorted([f"zero_optimization.{k}" for k in zero
                          if k not in ("stage", "stage3_param_persistence_threshold",
                                       "stage3_prefetch_bucket_size", "reduce_bucket_size")]
                         + [k for k in d if k not in ("zero_optimization", "bf16")])
        if ignored:
            warnings.warn(f"DeepSpeed config keys ignored by zeroshard: {', '.join(ignored)}",
                          stacklevel=3)
        whole = lambda v: int(v) if isinstance(v, float) and v == int(v) else v  # noqa: E731
        return cls(stage=stage, mixed_precision="bf16" if bf16 else None,
                   param_persistence_threshold=whole(persist),
                   prefetch_bucket_size=whole(prefetch), reduce_bucket_size=whole(bucket))

    @classmethod
    def load(cls, config) -> ZeroConfig:
        """A ZeroConfig from itself, a dict, or a JSON file path."""
        if isinstance(config, ZeroConfig):
            return config
        if isinstance(config, dict):
            return cls.from_dict(config)
        if isinstance(config, (str, Path)):
            return cls.from_dict(read_json_object(config, "config"))
        raise ValueError(f"config={config!r}; expected a ZeroConfig, a dict or a JSON file path")
