"""A trial: what both sides of a parity check run — the user's model, optimizer, batches
and loss, K steps — checked once, before anything is spawned.

The sharded side runs the trial on N processes through ``zs.shard`` (``shardedrun.py``),
the reference in this process on the plain model (``reference.py``); each rank reads
rows ``[r·B/N, (r+1)·B/N)`` of every global batch of B rows, the reference the same
slices one after the other, so each slice's forward and backward is the same arithmetic
on both sides and only the reductions across ranks can differ (``verdict.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..spec.config import ZeroConfig


def model_loss(model: nn.Module, batch) -> torch.Tensor:
    """The default loss: the model's output on the batch (``model(*batch)``, or
    ``model(**batch)`` for a dict) when it is a scalar, else its ``loss`` (a Hugging Face
    model given labels), else its first element."""
    out = model(**batch) if isinstance(batch, dict) else model(*_as_tuple(batch))
    if torch.is_tensor(out):
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, (tuple, list)) and out:
        loss = out[0]
    if not torch.is_tensor(loss) or loss.dim():
        raise ValueError(f"the model's output ({type(out).__name__}) is not a scalar loss "
                         "and holds none (no .loss, no first element); pass loss=fn(model, "
                         "batch) returning one")
    return loss


def _as_tuple(batch) -> tuple:
    return batch if isinstance(batch, (tuple, list)) else (batch,)


def rows_of(batch, rank: int, world: int):
    """Rows ``[rank·B/world, (rank+1)·B/world)`` of every tensor of a global batch (a
    tensor, a tuple or list of them, or a dict)."""
    def part(t):
        if not torch.is_tensor(t) or not t.dim():
            return t
        b = t.shape[0]
        return t[rank * b // world:(rank + 1) * b // world]

    if isinstance(batch, dict):
        return {k: part(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(part(t) for t in batch)
    return part(batch)


def on_device(batch, device: torch.device):
    """Every tensor of a batch on ``device``."""
    if isinstance(batch, dict):
        return {k: on_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(on_device(t, device) for t in batch)
    return batch.to(device) if torch.is_tensor(batch) else batch


def _batch_rows(batch, k: int) -> int:
    """The global batch size of batch ``k``: the rows of its tensors, which must agree."""
    values = batch.values() if isinstance(batch, dict) else _as_tuple(batch)
    rows = {t.shape[0] for t in values if torch.is_tensor(t) and t.dim()}
    if len(rows) != 1:
        raise ValueError(f"batches[{k}]: its tensors have {sorted(rows) or 'no'} rows; every "
                         "tensor of a global batch needs the same number of rows (dim 0)")
    return rows.pop()


@dataclass(frozen=True)
class Trial:
    """One parity check's inputs; validated at construction."""

    build_model: Callable[[], nn.Module]
    """Builds the model, the same way every call (it runs under ``torch.manual_seed(seed)``
    on each rank and in the reference); importable by name (a module-level function or
    a ``functools.partial`` of one), as the ranks are other processes."""
    build_optimizer: Callable
    """``build_optimizer(model)``: the optimizer (or a list: Muon's matrices and AdamW's
    rest) over ``model.parameters()`` — the shards on the sharded side."""
    batches: Sequence
    """K global batches, one per step: a tensor, a tuple of them or a dict, each tensor
    with the global batch's rows in dim 0 (a multiple of the data-parallel ranks)."""
    config: ZeroConfig
    """The engine's configuration, as ``zs.shard`` takes it."""
    nproc: int = 2
    """Local processes of the sharded side."""
    loss: Callable = model_loss
    """``loss(model, batch)``: the scalar loss of a rank's rows."""
    clip: float | None = None
    """Clip the gradients' global norm to this before each step (both sides)."""
    schedule: Callable[[int], float] | None = None
    """The learning rate's factor at each step, as torch's ``LambdaLR`` takes it, for
    every optimizer on both sides; None: a constant learning rate."""
    seed: int = 0
    """The seed ``build_model`` runs under."""
    timeout: float = 600.0
    """Seconds the sharded side may take before it is stopped and reported."""
    tp: int = 1
    """Tensor-parallel degree of the sharded side: each layer split over ``tp``
    consecutive ranks by ``tp_plan``, ZeRO over the ``nproc / tp`` data-parallel ones,
    which read the batch's rows (a tensor-parallel group reads the same)."""
    tp_plan: Callable | None = None
    """``tp_plan(model)``: torch's ``parallelize_module`` plan for the built model (the
    built-in GPT's ``GPT.TP_PLAN``, transformers' for a Hugging Face model)."""

    def __post_init__(self) -> None:
        if self.schedule is not None and not callable(self.schedule):
            raise ValueError(f"schedule={self.schedule!r} is not callable")
        for name in ("build_model", "build_optimizer", "loss"):
            if not callable(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} is not callable")
        if isinstance(self.nproc, bool) or not isinstance(self.nproc, int) or self.nproc < 1:
            raise ValueError(f"nproc={self.nproc!r}; expected a positive integer")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1 or (
                self.nproc % self.tp):
            raise ValueError(f"tp={self.tp!r}; expected a divisor of nproc={self.nproc}")
        if self.tp > 1 and not callable(self.tp_plan):
            raise ValueError(f"tp={self.tp} needs tp_plan, a function of the model giving "
                             "torch's parallelize_module plan")
        if not len(self.batches):
            raise ValueError("batches is empty; give one global batch per step to check")
        for k, batch in enumerate(self.batches):
            rows = _batch_rows(batch, k)
            if rows % self.dp_world:
                ranks = f"the {self.dp_world} data-parallel ranks" if self.tp > 1 else \
                    f"nproc={self.nproc}"
                raise ValueError(f"batches[{k}] has {rows} rows, which do not divide over "
                                 f"{ranks}; give a multiple of {self.dp_world}")
        if self.clip is not None and not (self.clip > 0):
            raise ValueError(f"clip={self.clip!r}; expected a positive number or None")
        config = self.config
        if config.recipe.param_dtype == "fp16":
            raise ValueError(f"mixed_precision={config.mixed_precision!r}: verify replays fp32 "
                             "and bf16 recipes; fp16's loss scaling skips and rescales steps "
                             "the reference would have to replay too; check the run at bf16")
        if config.quantize_weights or config.quantize_grads:
            raise ValueError("quantize_weights and quantize_grads round weights and gradients "
                             "to int8 blocks by design, so no run with them computes what the "
                             "unsharded model computes: verify the configuration without "
                             "them (bench/quantized_drift.py measures their drift)")

    @property
    def dp_world(self) -> int:
        """The data-parallel ranks: each reads its rows of every batch."""
        return self.nproc // self.tp

    @property
    def steps(self) -> int:
        return len(self.batches)

    def schedules(self, optimizers: list) -> list:
        """Each optimizer's ``LambdaLR`` (none without a schedule)."""
        if self.schedule is None:
            return []
        return [torch.optim.lr_scheduler.LambdaLR(o, self.schedule) for o in optimizers]
