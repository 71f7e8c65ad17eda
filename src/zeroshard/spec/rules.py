"""The rules that tie an option to a stage, and the disk-offload folder's checks: each
once, in one message, for ``ZeroConfig`` (and so for the engine and the planner alike)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
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


def most_at(stage: int, config) -> dict:
    """The fields of ``config`` that change at ``stage`` when it keeps the most of its
    options that ``stage`` takes: each rule of :func:`check_stage_options` read the other
    way (hpZ and qwZ at stage 3, qgZ where gradients are reduce-scattered, offload where
    the optimizer state is sharded, the weight shards' only where weights are; disk
    placement with the offload). The planner's table shows every stage of one
    configuration so."""
    policy = ShardPolicy.for_stage(stage)
    offload = config.offload if policy.shards_optimizer else None
    if offload == "params" and not policy.shards_params:
        offload = "optimizer"
    return {"stage": stage,
            "secondary_group": config.secondary_group if policy.shards_params else None,
            "quantize_weights": config.quantize_weights and policy.shards_params,
            "quantize_grads": config.quantize_grads and policy.reduce == "reduce_scatter",
            "offload": offload, "offload_dir": config.offload_dir if offload else None}


@dataclass(frozen=True)
class PlannedDisk:
    """``offload_dir`` for a plan: the offloaded optimizer state on disk, in a folder not
    chosen (:data:`PLANNED_DISK`).

    The planner asks where each category lives (``ShardPolicy.placement``: ``"disk"``),
    never which folder, so ``zeroshard plan --offload-dir`` — a yes/no flag — builds its
    ``ZeroConfig`` with this marker: the disk placement without a real folder, and no
    file system touched. The engine makes files under ``offload_dir`` and needs a real
    one: as a path the marker is a ValueError saying so (``os.fspath``, which every file
    call takes its folder through)."""

    def __repr__(self) -> str:
        return "PLANNED_DISK"

    def __fspath__(self) -> str:
        raise ValueError("offload_dir=PLANNED_DISK plans disk offload without a folder; "
                         "to run it, give offload_dir an existing writable directory")


#: The disk placement of a plan (:class:`PlannedDisk`).
PLANNED_DISK = PlannedDisk()


def check_disk(config) -> None:
    """``offload_dir`` and ``sub_group_size``: one line naming what cannot be used."""
    n = config.sub_group_size
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"sub_group_size={n!r} must be an integer >= 1 (elements of the "
                         "optimizer partition stepped at once)")
    where = config.offload_dir
    if where is None:
        return
    planned = isinstance(where, PlannedDisk)
    if not planned and (not isinstance(where, (str, Path)) or not str(where)):
        raise ValueError(f"offload_dir={where!r}; expected the path of a writable directory "
                         "(or PLANNED_DISK for a plan)")
    if not config.offload:
        shown = repr(where) if planned else repr(str(where))
        raise ValueError(f"offload_dir={shown} keeps the offloaded optimizer state on "
                         "disk, but offload=None: set offload='optimizer' (or 'params')")
    if planned:
        return
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
