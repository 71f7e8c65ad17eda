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


#: The record a folder that takes files beside the user's keeps of the names zeroshard
#: wrote there (an export, a profile's traces), [Note: a writer owns only what it wrote]
#: in ``checkpoint/sanity.py``.
RECORD = ".zeroshard-written.json"


def written(path: str | Path) -> set[str]:
    """The names zeroshard's writers recorded in folder ``path`` (none when no record)."""
    import json

    try:
        names = json.loads((Path(path) / RECORD).read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        return set()
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()


def claim(name: str, path: str | Path, names, patterns=()) -> None:
    """Before a writer puts ``names`` (and files matching ``patterns``, regular
    expressions, which it may replace or remove) into folder ``path``: each that exists
    was written there by zeroshard (its record holds it). Else one ValueError naming the
    file: a writer never replaces or removes what it did not write."""
    import re

    p = Path(path)
    if not p.is_dir():
        return
    ours = written(p)
    present = sorted({n for n in names if (p / n).exists() or (p / n).is_symlink()}
                     | {q.name for q in p.iterdir()
                        if any(re.fullmatch(pattern, q.name) for pattern in patterns)})
    foreign = [n for n in present if n not in ours]
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise ValueError(f"{name}={str(path)!r} holds {foreign[0]}{more}, which zeroshard did "
                         "not write there, and the output would replace it: give a new or "
                         "empty folder, or move the file away")


def record(path: str | Path, names, gone=()) -> None:
    """Add ``names`` to folder ``path``'s record of what zeroshard wrote there (and drop
    ``gone``, removed by the writer), written whole."""
    import json
    import os

    p = Path(path)
    files = sorted((written(p) - set(gone)) | set(names))
    tmp = p / f"{RECORD}.partial"
    tmp.write_text(json.dumps({"files": files}, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, p / RECORD)
