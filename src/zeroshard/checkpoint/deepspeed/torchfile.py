"""Reading a ``torch.save`` file without loading it: its structure now, tensor bytes on
demand, a slice at a time.

[Note: torch.save files] Since torch 1.6 ``torch.save`` writes a zip archive, every entry
stored uncompressed: ``<archive>/data.pkl`` (the pickled object, in which each tensor is a
call to ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`` and each
storage a persistent id ``("storage", StorageType, key, location, numel)``) and one entry
``<archive>/data/<key>`` per storage holding its raw bytes (``torch/serialization.py``:
``_save`` and ``_load``'s ``persistent_load``). So the pickle is unpickled here with every
tensor replaced by a :class:`Lazy` (file, byte offset, dtype, shape), and a tensor's
elements are read later with a plain ``seek`` and ``readinto``: host memory holds the
structure and the slice asked for, never a whole rank file. ``torch.load`` would read
every storage (or, with ``mmap=True``, keep every page it touched resident).

The unpickler builds only what a checkpoint's structure needs (containers, ``torch.Size``,
dtypes, tensors); any other class or function the pickle names (DeepSpeed's ``LossScaler``,
``ZeroStageEnum``, ``fragment_address``) becomes an inert :class:`Opaque` holding its
arguments. Nothing in the file runs, and DeepSpeed need not be installed to read it.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import sys
import zipfile
from pathlib import Path

import torch


class Opaque:
    """A pickled object of a class this reader does not build: its arguments and state,
    kept for inspection (an enum member's value is ``args[0]``)."""

    def __init__(self, *args, **kwargs):
        self.args, self.state = args, kwargs or None

    def __setstate__(self, state):
        self.state = state

    def __int__(self):  # DeepSpeed's ZeroStageEnum is an IntEnum pickled as cls(value)
        if len(self.args) == 1 and isinstance(self.args[0], int):
            return self.args[0]
        raise TypeError(f"{type(self).__name__} is not an integer")


def _opaque(module: str, name: str) -> type:
    return type(name, (Opaque,), {"__module__": f"opaque:{module}"})


class Lazy:
    """A tensor in a ``torch.save`` file, not read: where its bytes are and what they are."""

    def __init__(self, storage: tuple, offset: int, size, stride, dtype=None):
        # storage: (file, byte offset of its bytes in the file, its bytes, its dtype)
        self.file, self.start, self.storage_bytes, storage_dtype = storage
        self.dtype = dtype or storage_dtype
        self.offset, self.shape, self.stride = offset, tuple(size), tuple(stride)

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def _contiguous(self) -> bool:
        expect, ok = 1, True
        for d, s in zip(reversed(self.shape), reversed(self.stride)):
            ok &= d == 1 or s == expect
            expect *= d
        return ok

    def read(self, a: int = 0, b: int | None = None, out: torch.Tensor | None = None):
        """Elements [a, b) of the flattened tensor (all of it by default), read from the
        file into ``out`` (a 1-D tensor of b - a elements) or a new tensor."""
        b = self.numel() if b is None else b
        if not self._contiguous():
            raise ValueError(f"{self.file}: a tensor saved with strides {self.stride} for "
                             f"shape {self.shape}; only contiguous tensors are read")
        size = self.dtype.itemsize
        begin, n = (self.offset + a) * size, (b - a) * size
        if not 0 <= a <= b <= self.numel() or begin + n > self.storage_bytes:
            raise ValueError(f"{self.file}: elements [{a}, {b}) lie outside a saved tensor of "
                             f"{self.numel()} (a damaged file?)")
        out = torch.empty(b - a, dtype=self.dtype) if out is None else out
        with open(self.file, "rb") as f:
            f.seek(self.start + begin)
            if f.readinto(memoryview(out.view(torch.uint8).numpy())) != n:
                raise ValueError(f"{self.file}: ends inside a tensor (truncated?)")
        return out

    def load(self) -> torch.Tensor:
        """The whole tensor, in its shape."""
        return self.read().reshape(self.shape)


def _rebuild_tensor_v2(storage, offset, size, stride, *_):
    return Lazy(storage, offset, size, stride)


def _rebuild_tensor_v3(storage, offset, size, stride, _grad, _hooks, dtype, *_):
    return Lazy(storage, offset, size, stride, dtype)


#: the callables a checkpoint's pickle may name and that are built for real
_BUILT = {
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
    "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
    "torch._utils._rebuild_parameter": lambda data, *_: data,
    "torch._utils._rebuild_parameter_with_state": lambda data, *_: data,
    # a tensor with attributes (DeepSpeed sets ds_id on its flat groups): the tensor only
    "torch._tensor._rebuild_from_type_v2": lambda func, _type, args, _state: func(*args),
    "collections.OrderedDict": collections.OrderedDict,
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "torch.Size": torch.Size,
}


#: storage classes as a persistent id names them, and their element types
_STORAGES = {f"{k}Storage": v for k, v in {
    "Untyped": torch.uint8, "Float": torch.float32, "BFloat16": torch.bfloat16,
    "Half": torch.float16, "Double": torch.float64, "Long": torch.int64, "Int": torch.int32,
    "Short": torch.int16, "Char": torch.int8, "Byte": torch.uint8, "Bool": torch.bool}.items()}


class _Unpickler(pickle.Unpickler):
    def __init__(self, fh, path: str, records: dict[str, tuple[int, int]]):
        super().__init__(fh)
        self.path, self.records = path, records

    def find_class(self, module, name):
        built = _BUILT.get(f"{module}.{name}")
        if built is not None:
            return built
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
            if name in _STORAGES:
                return ("storage-type", _STORAGES[name])
        return _opaque(module, name)

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")):
            raise ValueError(f"{self.path}: an unknown persistent id in its pickle")
        _, kind, key, _location, _numel = pid
        key = key.decode() if isinstance(key, bytes) else str(key)
        if key not in self.records:
            raise ValueError(f"{self.path}: its pickle names storage {key!r}, which the "
                             "archive lacks (damaged?)")
        start, nbytes = self.records[key]
        dtype = kind[1] if isinstance(kind, tuple) else torch.uint8
        return (self.path, start, nbytes, dtype)


def _data_start(fh, info: zipfile.ZipInfo) -> int:
    """Where an entry's bytes begin: after its local header, whose extra field torch pads
    so the data is aligned (the central directory's copy of that field may differ)."""
    fh.seek(info.header_offset)
    head = fh.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise ValueError("bad local header")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + name_len + extra_len


def read_structure(path: str | Path):
    """The object ``torch.save`` wrote to ``path``, every tensor in it a :class:`Lazy`."""
    path = str(path)
    if sys.byteorder != "little":
        raise NotImplementedError("reading torch.save files on a big-endian host")
    try:
        with open(path, "rb") as fh, zipfile.ZipFile(fh) as z:
            pkl = [i for i in z.infolist() if i.filename.endswith("data.pkl")
                   and i.filename.count("/") == 1]
            if len(pkl) != 1:
                raise ValueError(f"{path}: not a torch.save archive (no data.pkl)")
            prefix = pkl[0].filename[:-len("data.pkl")]
            order = z.NameToInfo.get(prefix + "byteorder")
            if order is not None and z.read(order).strip() not in (b"little", b""):
                raise NotImplementedError(f"{path}: saved on a big-endian host")
            records = {}
            for info in z.infolist():
                if info.filename.startswith(prefix + "data/"):
                    if info.compress_type != zipfile.ZIP_STORED:
                        raise ValueError(f"{path}: {info.filename} is compressed; torch.save "
                                         "stores tensors uncompressed (rewritten by a tool?)")
                    records[info.filename[len(prefix) + 5:]] = (_data_start(fh, info),
                                                                info.file_size)
            raw = z.read(pkl[0])
    except zipfile.BadZipFile:
        raise ValueError(f"{path}: not a zip archive: written by torch.save before torch 1.6 "
                         "(the legacy format) or not a torch.save file") from None
    except (pickle.UnpicklingError, EOFError, struct.error) as exc:
        raise ValueError(f"{path}: damaged ({exc})") from None
    try:
        return _Unpickler(io.BytesIO(raw), path, records).load()
    except (pickle.UnpicklingError, EOFError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: its pickle cannot be read ({type(exc).__name__}: {exc})") \
            from None
