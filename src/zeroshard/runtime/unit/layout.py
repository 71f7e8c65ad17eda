"""Shard layout of one unit: per-parameter dim-0 chunks packed into one flat slot.

[Note: layout] Each parameter of d0 rows (0-d parameters count as one row of one) is
cut on dim 0 into N chunks of c = ceil(d0/N) rows; rank r owns rows [r·c, r·c + c),
of which ``real_rows(r)`` exist and the rest is padding. A rank's chunks of every
parameter of the unit, in order, form its *slot* of S elements; all N slots side by
side ([N, S], rank-major) are the all-gather output and the reduce-scatter input, so
each pass moves one contiguous buffer per unit (the copy-in/copy-out scheme of FSDP2).

Dim-0 chunks keep a parameter's trailing shape, so the optimizer's view of a shard is
``[real_rows, *shape[1:]]``: ``p.dim()`` stays meaningful for param groups written
for the unsharded model, and elementwise optimizers update each element exactly as
they would unsharded.

A full parameter lives in a padded storage of N·c rows viewed as ``[N, c·row]``, so a
gathered ``[N, S]`` buffer is copied out in one ``split_with_sizes_copy``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def dim0_chunk(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[a, b)`` of a parameter of ``rows`` rows that ``rank`` of ``world`` owns:
    chunks of c = ceil(rows / world) rows; the last ranks' chunks may be short or empty.
    The one place this arithmetic lives: the layout, clipping and checkpoints use it."""
    return _chunk(rows, rank, -(-rows // world))


def _chunk(rows: int, rank: int, c: int) -> tuple[int, int]:
    a = min(rows, rank * c)
    return a, min(rows, a + c)


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter sits in a unit's slot."""

    shape: tuple[int, ...]
    rows: int
    """d0: rows of the full parameter (1 for a 0-d parameter)."""
    row_numel: int
    """Elements per row: numel / rows."""
    chunk_rows: int
    """c = ceil(rows / N)."""
    offset: int
    """First element of this parameter's chunk within a slot."""

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @property
    def chunk_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    def real_rows(self, rank: int) -> int:
        """Rows of this parameter that rank owns (the rest of its chunk is padding)."""
        a, b = _chunk(self.rows, rank, self.chunk_rows)
        return b - a

    def shard_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of rank's shard as the optimizer sees it: ``[real_rows, *shape[1:]]``."""
        return (self.real_rows(rank), *self.shape[1:]) if self.shape else (self.real_rows(rank),)


class ShardLayout:
    """The slot layout of a list of parameter shapes over ``world`` ranks."""

    def __init__(self, shapes: list[tuple[int, ...]], world: int):
        self.world = world
        self.slots: list[ParamSlot] = []
        offset = 0
        for shape in shapes:
            rows = shape[0] if shape else 1
            row_numel = math.prod(shape[1:]) if shape else 1
            chunk_rows = -(-rows // world)  # c, as in dim0_chunk
            self.slots.append(ParamSlot(tuple(shape), rows, row_numel, chunk_rows, offset))
            offset += chunk_rows * row_numel
        self.slot_numel = offset
        """S: elements of one rank's slot, padding included."""

    @property
    def numel(self) -> int:
        """Real elements of the full parameters."""
        return sum(s.numel for s in self.slots)

    def real_numel(self, rank: int) -> int:
        """Real (non-padding) elements in rank's slot."""
        return sum(s.real_rows(rank) * s.row_numel for s in self.slots)

    @property
    def split_sizes(self) -> list[int]:
        return [s.chunk_numel for s in self.slots]

    def shard_views(self, flat: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """Views of a rank's flat slot ``[S]``, one per parameter, shaped as shards."""
        return [flat[s.offset:s.offset + s.real_rows(rank) * s.row_numel].view(s.shard_shape(rank))
                for s in self.slots]

    def padded_empty(self, slot: ParamSlot, dtype, device) -> torch.Tensor:
        """A full parameter in a padded storage of N·c rows, as ``[N, c·row]``."""
        return torch.empty(self.world, slot.chunk_numel, dtype=dtype, device=device)

    def pack(self, tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Copy full tensors (and any trailing [N, k] extras) into ``out`` as [N, S + k]:
        rank r's slot holds chunk r of each, zero-padded; casts to ``out``'s dtype."""
        torch._chunk_cat(tensors, 0, self.world, out=out.view(self.world, -1))
        return out

    def unpack_into(self, gathered: torch.Tensor, padded: list[torch.Tensor]) -> None:
        """Copy a gathered [N, S] buffer into full parameters' padded [N, c·row] storages."""
        torch.split_with_sizes_copy(gathered.view(self.world, -1), self.split_sizes, dim=1,
                                    out=padded)

    def unpack(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        """Full tensors (new storage) from a gathered [N, S] buffer."""
        g = gathered.view(self.world, -1)
        return [g[:, s.offset:s.offset + s.chunk_numel].reshape(-1)[:s.numel].view(s.shape)
                for s in self.slots]
