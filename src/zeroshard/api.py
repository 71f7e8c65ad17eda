"""``zs.shard``: the one call that turns a model into a sharded one.

It lives above ``runtime/`` and ``observe/`` because it joins them: the engine is
built by ``runtime``, and with ``profile=True`` the profiler of ``observe`` subscribes
to its lifecycle events.
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from ._errorline import told_plainly
from .runtime.model import ShardedModel
from .spec.config import ZeroConfig


def shard(model: nn.Module, stage: int | None = None, *, config=None, group=None,
          param_init=None, seed: int = 0, mesh=None, **options) -> ShardedModel:
    """Shard ``model`` over the data-parallel group (default: the whole world).

    ``mesh``: beside tensor parallelism, the ``DeviceMesh`` with dims ``("dp", "tp")`` (or
    ``("dp_replicate", "dp_shard", "tp")`` for hybrid sharding) whose ``"tp"`` dim the
    model was parallelized on (``torch.distributed.tensor.parallel.parallelize_module``):
    each rank's local slices are sharded over its data-parallel dims.

    ``stage`` and ``options`` are :class:`ZeroConfig` fields (``mixed_precision``,
    ``units``, ``reduce_dtype``, ``param_persistence_threshold``, ...); they override
    ``config``, which may be a ZeroConfig, a dict of its fields, a DeepSpeed config dict,
    or a path to either as JSON.

    A model built under ``torch.device("meta")`` is materialized one unit at a time:
    each module is initialised by ``param_init(module)`` (default: its
    ``reset_parameters()``) under a seed derived from ``seed`` and its name, exactly as
    ``zs.init_weights(model, seed, param_init)`` initialises an ordinary model."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"zs.shard() takes a torch.nn.Module; got {type(model).__name__} "
                         f"{_short(model)}")
    if next(model.parameters(), None) is None:
        raise ValueError(f"zs.shard(): {type(model).__name__} has no parameters, so there is "
                         "nothing to shard; shard the module that holds the weights")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={_short(seed)}; expected an integer")
    try:
        base = ZeroConfig.load(config) if config is not None else ZeroConfig()
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise ValueError(f"zs.shard() got unknown options {unknown}; accepted: "
                             f"{sorted(fields)}")
        if stage is not None:
            options["stage"] = stage
        if options:
            base = ZeroConfig(**{**fields, **options})
        sharded = ShardedModel(model, base, group, param_init, seed, mesh)
        if base.profile:
            from .observe.profiler import Profiler

            sharded.profiler = Profiler(sharded)
    except ValueError as exc:  # a value with a non-ASCII letter, a pasted file: said so
        exc.args = (told_plainly(str(exc)),)
        raise
    return sharded


def _short(value) -> str:
    """``repr(value)``, cut to a length an error line can carry."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
