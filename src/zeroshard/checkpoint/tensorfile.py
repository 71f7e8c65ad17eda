"""safetensors files written one tensor at a time, and file checksums.

The safetensors layout is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, byte offsets; plus ``__metadata__``), then the raw bytes. Every
shape is known before any data is written, so the header goes first and each tensor
is streamed straight from where it lives: a rank never copies its whole state to save
it, and an export holds one parameter at a time. Reading uses the ``safetensors``
library's lazy ``get_slice``, so a rank reads only the rows it needs.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable

import torch

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8",
           torch.bool: "BOOL"}
_CHUNK = 1 << 24


def write_tensors(path: str, entries: Iterable[tuple[str, tuple[int, ...], torch.dtype,
                                                     Callable[[], torch.Tensor]]],
                  metadata: dict[str, str] | None = None) -> tuple[str, int]:
    """Write a safetensors file from ``(name, shape, dtype, produce)`` entries, calling
    ``produce()`` for one tensor at a time; fsync it; return (sha256, bytes)."""
    entries = list(entries)
    header: dict = {"__metadata__": metadata or {}}
    offset = 0
    for name, shape, dtype, _ in entries:
        n = dtype.itemsize
        for d in shape:
            n *= d
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # data starts 8-byte aligned
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(head)), head):
            f.write(chunk)
            digest.update(chunk)
        for name, shape, dtype, produce in entries:
            t = produce().detach().to("cpu", dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise AssertionError(f"{name}: produced {tuple(t.shape)}, declared {shape}")
            data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            f.write(data)
            digest.update(data)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest(), os.path.getsize(path)


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
