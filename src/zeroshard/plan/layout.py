"""The planner's side of the layout: a ``ZeroConfig`` read against the
:class:`~zeroshard.spec.dims.ParallelDims` it is planned on.

[Note: planner inputs] Every planner function takes the configuration the engine runs
(``ZeroConfig``: the stage, the recipe, offload and its placement, ZeRO++, prefetch)
and the layout (``ParallelDims``: ranks, tensor parallelism, the shard group K, hpZ's
K2), beside the model and the workload. Sizes come from the layout; whether an option
is on comes from the configuration. A configuration that names a size must name the
layout's: an integer ``shard_group`` must be K (``"node"`` or a ``DeviceMesh`` leave K
to the layout), and hpZ's ``secondary_group`` is K2, checked to divide K as the engine
checks it (and equal to ``ParallelDims.secondary`` when the layout gives one).
"""

from __future__ import annotations

from ..spec.config import ZeroConfig
from ..spec.dims import ParallelDims
from ..spec.rules import most_at


def check_layout(dims: ParallelDims, config: ZeroConfig) -> None:
    """A ValueError when ``config`` names a size ``dims`` does not have."""
    if not isinstance(dims, ParallelDims):
        raise ValueError(f"dims={dims!r}; expected a ParallelDims (the ranks, tp, the shard "
                         "group K and hpZ's K2)")
    if not isinstance(config, ZeroConfig):
        raise ValueError(f"config={config!r}; expected a ZeroConfig")
    k = config.shard_group
    if isinstance(k, int) and k != dims.shard_size:
        raise ValueError(f"shard_group={k} in the ZeroConfig, but the layout shards over "
                         f"{dims.shard_size} ranks (ParallelDims.shard={dims.shard}); give "
                         "both the same K")
    secondary(dims, config)


def secondary(dims: ParallelDims, config: ZeroConfig) -> int | None:
    """K2 of the hpZ this configuration takes inside the layout's shard group: None when
    it takes none, or K2 = K (nothing kept, as the engine); a K2 that does not divide K
    is refused in the engine's words (``spec/dims.py``)."""
    k2 = config.secondary_group
    if k2 is None:
        return None
    if dims.secondary is not None and dims.secondary != k2:
        raise ValueError(f"secondary_group={k2} in the ZeroConfig, but ParallelDims."
                         f"secondary={dims.secondary}; give both the same K2")
    return ParallelDims(dims.world, dims.tp, dims.shard, k2).secondary_size


def dp_degree(gpus: int, tp: int = 1) -> int:
    """Data-parallel ranks when ``gpus`` GPUs run tensor parallelism of degree ``tp``."""
    return ParallelDims(gpus, tp).dp


def shard_degree(gpus: int, tp: int = 1, shard_group: int | None = None) -> int:
    """K, the ranks a stage shards over (``ParallelDims.shard_size``)."""
    return ParallelDims(gpus, tp, shard_group).shard_size


def takes_all(stage: int, config: ZeroConfig) -> bool:
    """Whether ``stage`` takes every option of ``config`` (``ZeroConfig.at_stage`` drops
    none of them)."""
    return all(getattr(config, name) == value for name, value in most_at(stage, config).items()
               if name != "stage")


def stages_taking(config: ZeroConfig) -> list[ZeroConfig]:
    """``config`` at each stage that takes all of its options, lowest first (offload
    ``"optimizer"``: stages 1-3; ``"params"``: stage 3)."""
    return [config.at_stage(s) for s in range(4) if takes_all(s, config)]
