"""safetensors files written one tensor at a time, and file checksums.

The safetensors layout is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, byte offsets; plus ``__metadata__``), then the raw bytes. Every
shape is known before any data is written, so the header goes first and each tensor
is streamed straight from where it lives: a rank never copies its whole state to save
it, and an export holds one parameter at a time. :class:`TensorFile` reads row ranges
with plain reads (a memory map would leave every page it touched resident), so a rank
reads, and holds, only the rows it needs.
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


_FROM_NAME = {v: k for k, v in _DTYPES.items()}


def _entry_problem(info, data_bytes: int) -> str | None:
    """What is wrong with one header entry (dtype, shape, offsets inside the data), or
    None: checked once, so reading rows can trust it."""
    if not isinstance(info, dict) or info.get("dtype") not in _FROM_NAME:
        return "no known dtype"
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        return f"shape {shape!r}"
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)):
        return f"data_offsets {offsets!r}"
    n = _FROM_NAME[info["dtype"]].itemsize
    for d in shape:
        n *= d
    if not 0 <= offsets[0] <= offsets[1] <= data_bytes or offsets[1] - offsets[0] != n:
        return f"data_offsets {offsets} for {n} bytes in {data_bytes}"
    return None


class TensorFile:
    """Reads rows of tensors from a safetensors file with plain reads (no memory map), so
    a reader's memory holds only the rows it asked for."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{path}: not a safetensors file (truncated header)")
            (n,) = struct.unpack("<Q", raw)
            # the length is the file's word, not ours: believed, a text file's first 8
            # bytes ask for exabytes (a MemoryError); a header cannot outrun its file
            if n > size - 8:
                raise ValueError(f"{path}: not a safetensors file (its first 8 bytes give a "
                                 f"header of {n:,} bytes; the file has {size:,})")
            try:
                self.header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ValueError(f"{path}: not a safetensors file (bad header)") from None
        if not isinstance(self.header, dict):
            raise ValueError(f"{path}: not a safetensors file (the header is not an object)")
        self.data_start = 8 + n
        self.metadata = self.header.pop("__metadata__", {}) or {}
        for name, info in self.header.items():
            problem = _entry_problem(info, size - self.data_start)
            if problem:
                raise ValueError(f"{path}: not a safetensors file ({name!r}: {problem})")

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return _FROM_NAME[self.header[name]["dtype"]]

    def rows(self, name: str, a: int | None = None, b: int | None = None) -> torch.Tensor:
        """Rows [a, b) of tensor ``name`` (all of it by default; a 0-d tensor has one)."""
        info, shape, dtype = self.header[name], self.shape(name), self.dtype(name)
        rows = shape[0] if shape else 1
        a, b = (0, rows) if a is None else (a, b)
        begin, end = info["data_offsets"]
        row_bytes = (end - begin) // rows if rows else 0
        out = torch.empty(((b - a) * row_bytes,), dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin + a * row_bytes)
            if f.readinto(memoryview(out.numpy())) != out.numel():
                raise ValueError(f"{self.path}: {name!r} runs past the end of the file")
        t = out.view(dtype)
        return t.reshape((b - a, *shape[1:])) if shape else t.reshape(())
