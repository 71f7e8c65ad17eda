"""This machine's memory, as the checks before a launch need it: how many bytes a new
process could still take (pure Python: the planner's side imports it too)."""

from __future__ import annotations

import os
from pathlib import Path

#: What one process of the engine holds before any tensor of its own: the interpreter,
#: torch and gloo (about 300 MB measured; a lower bound, so that no run that would fit
#: is refused).
PROCESS_BYTES = 250 * 10**6


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    """Bytes left under this process's cgroup (v2) memory limit, if it has one."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        return max(0, int(limit) - used)
    except (OSError, ValueError):
        return None


def available_bytes() -> int | None:
    """Bytes of memory new processes can still take here: the kernel's estimate of
    available memory, capped by a container's limit; None where neither is known."""
    found = [b for b in (_meminfo_available(), _cgroup_room()) if b is not None]
    if not found and hasattr(os, "sysconf"):
        try:
            found = [os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")]
        except (OSError, ValueError):
            pass
    return min(found) if found else None


def gb(n: float) -> str:
    """Bytes in decimal GB (MB below one GB), as the error lines give them."""
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"
