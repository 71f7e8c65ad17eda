"""Disk offload's files: each unit's fp32 master and Adam's two moments in one file.

A unit's file holds three planes of the unit's optimizer slot (``g_layout.slot_numel``
fp32 elements each, padding included): the master, ``exp_avg``, ``exp_avg_sq``. The
files of one model on one rank live in a scratch folder of their own under
``offload_dir`` (``zeroshard-offload-rankR-*``); a unit's file goes when its unit does,
and at the latest when the process exits cleanly (``weakref.finalize``), and the folder
with its last file. They are never a checkpoint: ``zs.save`` reads them into its own
files, and a crash leaves the last checkpoint the only truth.

Two ways in, for two kinds of reader:

* The step streams sub-groups with ``os.preadv``/``os.pwritev`` into buffers it owns
  (``stream.py``). Plain file I/O because the kernel's page cache is not the process's
  memory: the process holds exactly the buffers, the calls release the GIL (so a
  background thread reads and writes while torch's kernel steps), and a write that fails
  (a full disk) is an ``OSError`` here, not a ``SIGBUS`` in the middle of a kernel.
* Everyone else — ``state_dict()``, ``zs.save``, ``full_state_dict()``, loading — sees
  tensors: the master and moments as ``torch.frombuffer`` views of a shared ``mmap`` of
  the same file (one page cache, so both ways agree). What such a reader touches is
  mapped into the process until the next step drops it (``MADV_DONTNEED``: the pages
  stay in the page cache and in the file).

Every byte is written when the file is made (the master, then zeros): a disk too small
for the state is an error at ``zs.shard``, and later writes only overwrite allocated
blocks.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
import weakref

import torch
import torch.distributed as dist

#: The planes of a unit's file, in order.
PLANES = ("master", "exp_avg", "exp_avg_sq")
_ITEM = 4  # fp32
_CHUNK = 1 << 26  # bytes per read or write call (Linux moves at most ~2 GiB per call)
_FOLDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # comm -> its folder


class OffloadDiskError(RuntimeError):
    """The optimizer state's files could not be written or read."""


def io_error(exc: OSError, path: str, what: str) -> OffloadDiskError:
    """One line naming the path, what was being done and why it failed."""
    folder = os.path.dirname(os.path.dirname(path))
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return OffloadDiskError(
            f"offload_dir {folder!r} is full: {what} {path} failed ({exc.strerror}); the "
            "run stops here and checkpoints saved before are untouched: free space or "
            "choose another offload_dir")
    return OffloadDiskError(f"offload_dir {folder!r}: {what} {path} failed "
                            f"({exc.strerror or exc})")


def scratch_folder(offload_dir: str, comm) -> str:
    """The folder this model's files go in on this rank (one per ``Collectives``)."""
    folder = _FOLDERS.get(comm)
    if folder is None or not os.path.isdir(folder):  # none yet, or removed once emptied
        try:
            folder = tempfile.mkdtemp(prefix=f"zeroshard-offload-rank{comm.mesh.dp_rank}-",
                                      dir=offload_dir)
        except OSError as exc:
            raise io_error(exc, os.path.join(offload_dir, "x", "x"),
                           "making a scratch folder in") from None
        _FOLDERS[comm] = folder
    return folder


def _remove(fd: int, path: str) -> None:
    for step in (lambda: os.close(fd), lambda: os.unlink(path),
                 lambda: os.rmdir(os.path.dirname(path))):  # the folder, once empty
        try:
            step()
        except OSError:
            pass


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


class UnitFile:
    """The file of one unit's master and moments, ``numel`` fp32 elements a plane."""

    def __init__(self, folder: str, index: int, master: torch.Tensor):
        self.numel = master.numel()
        self.path = os.path.join(folder, f"unit{index:05d}.bin")
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise io_error(exc, self.path, "creating") from None
        self.remove = weakref.finalize(self, _remove, self.fd, self.path)
        """Close and delete the file now (it is, at the latest, when this object goes)."""
        self.write(0, master.detach().cpu().float().contiguous(), "writing the master to")
        zeros = torch.zeros(min(self.numel, _CHUNK // _ITEM), dtype=torch.float32)
        for plane in (1, 2):
            self.fill(plane, 0, self.numel, zeros)
        self._map = mmap.mmap(self.fd, 3 * self.numel * _ITEM)
        self.planes = torch.frombuffer(self._map, dtype=torch.float32).view(3, self.numel)
        """The three planes as tensors over the file (see the module's note)."""

    def _io(self, offset: int, view: memoryview, write: bool, what: str) -> None:
        if not self.remove.alive:  # its descriptor is closed and may name another file now
            raise OffloadDiskError(f"offload_dir: {self.path} was removed after a step failed "
                                   "on it; this model cannot step again: resume from the "
                                   "last checkpoint")
        done = 0
        while done < len(view):
            part = view[done:done + _CHUNK]
            try:
                n = (os.pwritev(self.fd, [part], offset + done) if write
                     else os.preadv(self.fd, [part], offset + done))
            except OSError as exc:
                raise io_error(exc, self.path, what) from None
            if n == 0:
                raise OffloadDiskError(f"offload_dir: {self.path} ends before byte "
                                       f"{offset + done} (truncated by another program?)")
            done += n

    def write(self, start: int, values: torch.Tensor, what: str = "writing to",
              plane: int = 0) -> None:
        """Write fp32 ``values`` at element ``start`` of ``plane``."""
        self._io((plane * self.numel + start) * _ITEM, _bytes(values), True, what)

    def read(self, start: int, out: torch.Tensor, plane: int = 0) -> None:
        """Read ``out.numel()`` elements from element ``start`` of ``plane``."""
        self._io((plane * self.numel + start) * _ITEM, _bytes(out), False, "reading")

    def fill(self, plane: int, start: int, stop: int, zeros: torch.Tensor) -> None:
        """Zeros over elements [start, stop) of ``plane`` (``zeros`` a zero buffer)."""
        while start < stop:
            n = min(stop - start, zeros.numel())
            self.write(start, zeros[:n], "writing zeros to", plane)
            start += n

    def drop_mapped(self) -> None:
        """Unmap what readers of the tensors touched (it stays in the page cache)."""
        self._map.madvise(mmap.MADV_DONTNEED)


def place_on_disk(master: torch.Tensor, offload_dir: str, comm, index: int):
    """Move a unit's freshly filled master into its file: ``(file, master plane)``; a
    unit with nothing to step keeps its empty master and gets no file."""
    if not master.numel():
        return None, master
    disk, problem = None, None
    try:
        disk = UnitFile(scratch_folder(offload_dir, comm), index, master)
    except OffloadDiskError as exc:
        problem = f"rank {comm.mesh.dp_rank}: {exc}"
    # Every rank learns of a failure on any (one disk fuller than another's): all stop
    # here with the same line, rather than the others wait in a later collective.
    problems = [None] * comm.mesh.dp_world
    dist.all_gather_object(problems, problem, group=comm.mesh.dp_group)
    first = next((p for p in problems if p), None)
    if first:
        raise OffloadDiskError(first)
    return disk, disk.planes[0]
