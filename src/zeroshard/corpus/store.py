"""The packed token store on a rank: a split's token segments cut into windows, and the
global batch of a step as window indices, of which a rank reads only its own rows.

A window is ``seq_len + 1`` consecutive tokens of one segment; window ``i`` starts at
token ``i * seq_len`` (stride ``seq_len``), so consecutive windows share one token and
every token after a segment's first is a target exactly once. The inputs are a window's
first ``seq_len`` tokens, the targets its last ``seq_len``. Windows run across document
boundaries (packing); the boundary id marks where one document ends.

Position ``p = step * rows + j`` of the stream of batches is window
``permute(p mod W; seed, epoch = p div W)`` of the split's ``W`` windows: each epoch
visits every window once in its own order and the stream wraps into the next epoch, so
the batch of a step does not depend on how many ranks share it, and the ranks' parts of
one step never overlap. Validation batches are drawn the same way from the held-out
split, so the batches of (seed, step) are fixed.
"""

from __future__ import annotations

import numpy as np
import torch

from .order import permute
from .prepare import SPLITS, PreparedCorpus, check_length
from .tokenfile import open_tokens


class _Windows:
    """A split's windows: where window ``i`` starts, across its segments."""

    def __init__(self, info: PreparedCorpus, split: str, seq_len: int):
        self.seq_len = seq_len
        self.maps = [open_tokens(s.path, s.dtype) for s in info.segments(split)]
        self.starts = [s.start for s in info.segments(split)]
        counts = [max(0, (s.stop - s.start - 1) // seq_len) for s in info.segments(split)]
        self.first = np.cumsum([0] + counts)  # the first window of each segment
        self.count = int(self.first[-1])

    def read(self, windows: np.ndarray) -> np.ndarray:
        """The tokens of ``windows`` as an int64 array ``[len(windows), seq_len + 1]``."""
        out = np.empty((len(windows), self.seq_len + 1), dtype=np.int64)
        segment = np.searchsorted(self.first, windows, side="right") - 1
        for row, (w, s) in enumerate(zip(windows.tolist(), segment.tolist())):
            at = self.starts[s] + (w - int(self.first[s])) * self.seq_len
            out[row] = self.maps[s][at:at + self.seq_len + 1]
        return out


class PackedCorpus:
    """A prepared corpus opened for ``seq_len``; see the module docstring."""

    def __init__(self, info: PreparedCorpus, seq_len: int):
        if not (isinstance(seq_len, int) and seq_len >= 1):
            raise ValueError(f"seq_len={seq_len!r} is not a positive integer")
        check_length(info, seq_len)
        self.info, self.seq_len = info, seq_len
        self._splits = {split: _Windows(info, split, seq_len) for split in SPLITS}

    @property
    def eos_id(self) -> int | None:
        """The id that ends each document (None for token files read without a
        tokenizer)."""
        return self.info.eos_id

    def _split(self, split: str) -> _Windows:
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not a split; accepted: {', '.join(SPLITS)}")
        return self._splits[split]

    def sequences(self, split: str) -> int:
        """Windows (sequences of ``seq_len``) in ``split``: one epoch."""
        return self._split(split).count

    def tokens(self, split: str) -> int:
        return self.info.tokens(split)

    def windows(self, split: str, seed: int, step: int, rows: int,
                part: slice = slice(None)) -> np.ndarray:
        """The window indices of rows ``part`` of the global batch of ``rows`` for
        (``seed``, ``step``)."""
        w = self._split(split)
        if not (isinstance(rows, int) and rows >= 1):
            raise ValueError(f"rows={rows!r} is not a positive integer")
        if not (isinstance(step, int) and step >= 0):
            raise ValueError(f"step={step!r} is not a step (an integer >= 0)")
        positions = np.arange(rows, dtype=np.int64)[part] + step * rows
        epochs, index = np.divmod(positions, w.count)
        out = np.empty_like(positions)
        for epoch in np.unique(epochs).tolist():
            mine = epochs == epoch
            out[mine] = permute(index[mine], w.count, seed, epoch, split)
        return out

    def batch(self, split: str, seed: int, step: int, rows: int, seq_len: int,
              part: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``part`` of the global batch of (``seed``, ``step``): (inputs, targets),
        int64 ``[len(part), seq_len]``, targets the inputs shifted by one token. Only
        those rows are read from disk."""
        if seq_len != self.seq_len:
            raise ValueError(f"seq_len={seq_len!r} differs from the seq_len={self.seq_len} "
                             "this corpus was opened with; open it again with open_corpus")
        tokens = torch.from_numpy(
            self._split(split).read(self.windows(split, seed, step, rows, part)))
        return tokens[:, :-1], tokens[:, 1:]


def open_corpus(info: PreparedCorpus, seq_len: int) -> PackedCorpus:
    """Open ``info`` (from ``prepare_corpus``) on a rank: its token files are memory-mapped,
    nothing is loaded."""
    return PackedCorpus(info, seq_len)
