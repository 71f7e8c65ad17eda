"""Output paths checked before any work: a folder that must take files, a file that
must take appends. Each problem is one ValueError naming the setting, the path and
what is wrong, so a command finds it before it has trained, read or written anything.
Pure Python: the planner (which never imports torch) uses it too."""

from __future__ import annotations

import os
from pathlib import Path


def folder(name: str, path: str | Path) -> None:
    """``path`` is (or can be made) a folder this user can write into."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{name}={str(path)!r} is a file, not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".zeroshard-probe-{os.getpid()}"
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"{name}={str(path)!r} cannot be written ({exc.strerror or exc}); "
                         "give a folder this user can write") from None


def output_file(name: str, path: str | Path) -> None:
    """``path`` can be opened for appending: its folder exists and takes writes, and it is
    not a folder. A file that was not there is not left behind."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{name}={path} is a folder; give a file name")
    parent = p.parent
    if not parent.is_dir():
        raise ValueError(f"{name}={path}: folder {parent} does not exist")
    existed = p.exists()
    try:
        with open(p, "a", encoding="utf-8"):
            pass
        if not existed:
            p.unlink()
    except OSError as exc:
        raise ValueError(f"{name}={path} cannot be written ({exc.strerror or exc})") from None
