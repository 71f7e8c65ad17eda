"""The rules that tie an option to a stage, and the disk-offload folder's checks: each
once, in one message, for ``ZeroConfig`` (and so for the engine and the planner alike)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from .policy import ShardPolicy

#: What ``ZeroConfig.offload`` accepts besides None.
OFFLOADS = ("optimizer", "params")


def check_stage_options(stage: int, *, secondary_group: int | None = None,
                        quantize_weights: bool = False, quantize_grads: bool = False,
                        reduce_dtype: str | None = None, offload: str | None = None) -> None:
    """Every rule that ties an option to what ``stage`` shards, one message each: ZeRO++'s
    hpZ and qwZ act on gathered weights (stage 3), qgZ on a reduce-scatter (stages 1-3);
    offload moves sharded optimizer state (stages 1-3), and the weight shards only where
    the weights are sharded (stage 3)."""
    policy = ShardPolicy.for_stage(stage)
    if secondary_group is not None and not policy.shards_params:
        raise ValueError(f"secondary_group={secondary_group} (hpZ) keeps gathered weights "
                         "between forward and backward, which only stage 3 releases; got "
                         f"stage={stage}: use stage 3 or drop secondary_group")
    if quantize_weights and not policy.shards_params:
        raise ValueError(f"quantize_weights (qwZ) quantizes stage 3's gathers of the "
                         f"weights; got stage={stage}: use stage 3")
    if quantize_grads and policy.reduce != "reduce_scatter":
        raise ValueError("quantize_grads (qgZ) quantizes the gradients' reduce-scatter, "
                         "which stage 0 does not do (it all-reduces); use stage 1-3")
    if quantize_grads and reduce_dtype is not None:
        raise ValueError(f"quantize_grads sends the gradients as int8 and sums them in "
                         f"fp32; reduce_dtype={reduce_dtype!r} asks for another "
                         "reduction: drop one of the two")
    if offload and not policy.shards_optimizer:
        raise ValueError(f"offload={offload!r} moves the sharded optimizer state to "
                         "the host; stage 0 shards nothing: use stage 1-3")
    if offload == "params" and not policy.shards_params:
        raise ValueError(f"offload='params' keeps the weight shards on the host, which "
                         f"only stage 3 has; got stage={stage}: use stage 3 or "
                         "offload='optimizer'")


def check_disk(config) -> None:
    """``offload_dir`` and ``sub_group_size``: one line naming what cannot be used."""
    n = config.sub_group_size
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"sub_group_size={n!r} must be an integer >= 1 (elements of the "
                         "optimizer partition stepped at once)")
    where = config.offload_dir
    if where is None:
        return
    if not isinstance(where, (str, Path)) or not str(where):
        raise ValueError(f"offload_dir={where!r}; expected the path of a writable directory")
    if not config.offload:
        raise ValueError(f"offload_dir={str(where)!r} keeps the offloaded optimizer state on "
                         "disk, but offload=None: set offload='optimizer' (or 'params')")
    path = Path(where)
    if not path.exists():
        raise ValueError(f"offload_dir={str(where)!r} does not exist; expected an existing "
                         "writable directory")
    if not path.is_dir():
        raise ValueError(f"offload_dir={str(where)!r} is not a directory; expected an "
                         "existing writable directory")
    try:  # the file system's answer, not the permission bits (root passes os.access)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"offload_dir={str(where)!r} is not writable ({exc.strerror or exc});"
                         " expected an existing writable directory") from None
    object.__setattr__(config, "offload_dir", str(where))
