"""Peak bytes in use on the C heap, sampled: the CPU counterpart of CUDA's
``max_memory_allocated``.

``ru_maxrss`` (resident pages) also counts what the allocator keeps after a free:
glibc raises its mmap threshold to the size of the largest block freed so far, and
blocks below it then come from arenas that fragment and rarely shrink, so the same live
bytes can leave different resident sets depending on the order of allocations.
``mallinfo2()`` gives the bytes actually handed out (arena chunks in use plus mmapped
chunks); a thread reads it every half millisecond. Torch's CPU tensors, gloo's buffers
and Python's large objects all come from this heap.
"""

from __future__ import annotations

import ctypes
import threading
import time


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]


def _in_use_reader():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):  # not glibc, or glibc older than 2.33
        return None

    def read() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd
    return read


class HeapPeak:
    """``start()``, run the work, ``stop()``; ``growth`` is the peak in-use bytes over
    the bytes in use at ``start()`` (None where glibc's mallinfo2 is unavailable)."""

    def __init__(self, interval: float = 5e-4):
        self._read = _in_use_reader()
        self.interval = interval
        self.base = self.peak = 0
        self._thread = None
        self._running = False

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, self._read())
            time.sleep(self.interval)

    def start(self) -> HeapPeak:
        if self._read is not None:
            self.base = self.peak = self._read()
            self._running = True
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._running = False
            self._thread.join()
            self.peak = max(self.peak, self._read())
            self._thread = None

    @property
    def growth(self) -> int | None:
        return None if self._read is None else self.peak - self.base
