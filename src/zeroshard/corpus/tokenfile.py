"""Flat token files (nanoGPT's ``.bin`` layout: token ids back to back, no header), read
through memory maps so a file larger than memory is never loaded: their dtype, their
checks (a whole number of ids, every id inside the vocabulary) and where a document
boundary falls near a position.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from .errors import DataError

DTYPES = ("uint16", "uint32")
_CHUNK = 1 << 24  # ids per scanned chunk: 32-64 MiB of file, a bounded slice of memory


def choose_dtype(ids_below: int, requested: str | None) -> str:
    """uint16 when every id fits (ids below 65,536), else uint32; ``requested`` overrides,
    if it can hold the ids."""
    if requested is None:
        return "uint16" if ids_below <= 1 << 16 else "uint32"
    if requested not in DTYPES:
        raise DataError(f"token_dtype={requested!r} is not a token file dtype; accepted: "
                        f"{', '.join(DTYPES)}")
    if requested == "uint16" and ids_below > 1 << 16:
        raise DataError(f"token_dtype='uint16' cannot hold a vocabulary of {ids_below:,} "
                        "ids (the most is 65,536); use uint32")
    return requested


def open_tokens(path: str | Path, dtype: str) -> np.ndarray:
    """A read-only memory map of ``path`` as ``dtype`` ids."""
    size = Path(path).stat().st_size
    width = np.dtype(dtype).itemsize
    if size % width:
        raise DataError(f"token file {str(path)!r} has {size:,} bytes, not a multiple of "
                        f"{width}: the ids of this model's vocabulary are read as {dtype} "
                        "(uint16 up to 65,536 ids, else uint32); give a flat array of "
                        f"{dtype} ids, whole (a file cut short, or written in another dtype?)")
    if size == 0:  # numpy cannot map an empty file
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def largest_id(ids: np.ndarray, advance: Callable[[int], None] | None = None) -> int:
    """The largest id in ``ids``, scanned a chunk at a time (-1 when empty)."""
    largest = -1
    for lo in range(0, len(ids), _CHUNK):
        chunk = ids[lo:lo + _CHUNK]
        largest = max(largest, int(chunk.max()))
        if advance is not None:
            advance(chunk.nbytes)
    return largest


def check_width(path: str | Path, ids: np.ndarray) -> None:
    """Refuse uint32 ids read as uint16: little-endian, each id below 65,536 leaves every
    second uint16 zero, and every value passes the vocabulary check, so the model would
    train on the ids interleaved with zeros. Judged on the first 65,536 values."""
    head = np.asarray(ids[:1 << 16])
    if ids.dtype == np.uint16 and len(head) >= 64 and not head[1::2].any() and head.any():
        raise DataError(f"token file {str(path)!r} reads as uint16 ids with every second one "
                        "0: it holds uint32 ids; write it as uint16 (nanoGPT's layout), as "
                        "this vocabulary fits")


def check_vocabulary(path: str | Path, largest: int, vocab: int) -> None:
    if largest >= vocab:
        raise DataError(f"token file {str(path)!r} holds id {largest:,}, outside the "
                        f"vocabulary of {vocab:,} (ids 0 to {vocab - 1:,}); give token "
                        "files written with this model's tokenizer")


def nearest_boundary(ids: np.ndarray, pos: int, boundary: int) -> int | None:
    """The position just after the ``boundary`` id nearest to ``pos``, strictly inside
    ``ids`` (so both sides are non-empty); None when there is none. The scan widens from
    ``pos`` a doubling radius at a time, so a nearby boundary costs a small read."""
    n = len(ids)
    radius = 1 << 16
    while True:
        lo, hi = max(0, pos - radius), min(n, pos + radius)
        hits = np.flatnonzero(ids[lo:hi] == boundary) + lo + 1
        hits = hits[(hits > 0) & (hits < n)]
        if len(hits):
            return int(hits[np.argmin(np.abs(hits - pos))])
        if lo == 0 and hi == n:
            return None
        radius *= 2
