"""Tensor parallelism's own collectives, counted for the ledger's ``"tp"`` level.

[Note: counting tensor-parallel collectives] The all-reduces, all-gathers and
reduce-scatters of tensor parallelism are issued by DTensor inside the model's forward
and backward (a ``RowwiseParallel`` output made ``Replicate()``, the ``Partial()`` input
gradient of a ``ColwiseParallel`` layer, ``SequenceParallel``'s gathers), as
``_c10d_functional`` ops, never through the engine's :class:`Collectives`. They are
counted where torch counts them itself (``CommDebugMode`` in
``torch/distributed/tensor/debug/_comm_mode.py``): a dispatch mode that sees every op
and records the ``_c10d_functional`` collectives, bytes in ring accounting over their
group. The mode is on from the model's forward (``hooks.py``) to the optimizer step,
so the backward, which runs under the thread state of the ``.backward()`` call, is
seen too; a forward without gradients ends it at once. Only while a tp axis exists:
without one the model runs with no mode at all.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _pop_mode,
    _push_mode,
)

#: ``_c10d_functional`` op -> (ledger kind, whether its output holds the bytes that count:
#: an all-gather's T is its output, a reduce-scatter's and an all-reduce's their input).
KINDS = {"all_reduce": ("all_reduce", False), "all_reduce_": ("all_reduce", False),
         "all_gather_into_tensor": ("all_gather", True),
         "reduce_scatter_tensor": ("reduce_scatter", False),
         "broadcast": ("broadcast", False), "broadcast_": ("broadcast", False)}


def _watched() -> dict:
    """The ``_c10d_functional`` op overloads of :data:`KINDS` -> (kind, output counts)."""
    import torch

    ops = torch.ops._c10d_functional
    return {getattr(ops, name).default: kind for name, kind in KINDS.items()
            if hasattr(ops, name)}


class _Mode(TorchDispatchMode):
    def __init__(self, comm) -> None:
        super().__init__()
        self.comm = comm
        self.watched = _watched()  # one dict lookup per op: the mode sees every op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **kwargs) if kwargs else func(*args)
        kind = self.watched.get(func)
        if kind is not None:
            t = out if kind[1] else args[0]
            name = kwargs.get("group_name", args[-1]) if kwargs else args[-1]
            group = dist.distributed_c10d._resolve_process_group(name)
            self.comm.record_tp(kind[0], t.numel() * t.element_size(), group.size())
        return out


class TPCounter:
    """The dispatch mode of one sharded model, on from a forward to the step (see the
    note); a listener of the model's events for the step."""

    def __init__(self, comm) -> None:
        self.mode = _Mode(comm)
        self.on = False

    def start(self) -> None:
        if not self.on:
            _push_mode(self.mode)
            self.on = True

    def stop(self) -> None:
        """Off, where it is the innermost mode (a mode the user entered since stays
        theirs; the next forward finds this one still on)."""
        if self.on and _get_current_dispatch_mode() is self.mode:
            _pop_mode()
            self.on = False

    def event(self, kind: str, unit=None, **info) -> None:
        if kind == "step_begin":
            self.stop()
