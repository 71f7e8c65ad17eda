"""A checkpoint folder believed only once it is what zeroshard writes, and replaced only
when it is.

A ``latest`` pointer and a ``manifest.json`` are plain files: another program (or an
edit, or a newer zeroshard) may have written them. Before anything is read on their
word, the pointer must name a folder beside it, and the manifest must be of the version
this zeroshard reads and of the shape it writes, its files inside the checkpoint folder
(``../../x`` in a manifest would have been read, and checksummed, wherever it led).

[Note: a writer owns only what it wrote] A save replaces its folder whole (written
aside as ``NAME.partial``, the old copy moved to ``NAME.old`` and dropped) and a
``latest`` pointer beside it. ``zs.save(model, opt, "mydata")`` once removed a folder of
the user's own files that way, and renamed a file in its place to ``mydata.old``. So
every path a save would replace or remove is checked first, and must be what a save
leaves there: the folder nothing, or exactly an earlier checkpoint (its manifest and
the files the manifest lists); ``NAME.partial`` only rank files and a manifest;
``NAME.old`` an earlier checkpoint; ``latest`` a one-line pointer. Anything else is
refused by name before a byte is written (:func:`check_target`), and the clean-up after
a save (:func:`ours_partial`, :func:`pure_checkpoint`) removes only what passes the same
tests. Exports and other folders that take files beside the user's keep a record of
the names they wrote instead (``zeroshard._paths.claim``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

FORMAT = "zeroshard-checkpoint"
MANIFEST = "manifest.json"
LATEST = "latest"
#: The files a checkpoint's folder holds besides its manifest (``sharded._write_rows``).
_RANK_FILE = re.compile(r"rank\d{5}\.safetensors")
#: The most a pointer file holds: one folder name and a newline.
_POINTER_BYTES = 512

#: The manifest version this zeroshard writes and reads.
VERSION = 1


def pointed(pointer: Path) -> str:
    """The folder name a ``latest`` pointer holds: one name beside it."""
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{pointer} cannot be read as a checkpoint pointer "
                         f"({getattr(exc, 'strerror', None) or exc})") from None
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise ValueError(f"{pointer} names {name!r}, not a checkpoint folder beside it "
                         "(written by another program?)")
    return name


def _rows_ok(rows) -> bool:
    return isinstance(rows, dict) and all(
        isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r)
        and 0 <= r[0] <= r[1] for r in rows.values())


def check_manifest(manifest: dict, where: Path) -> None:
    """``manifest`` (of ``where``) holds what zeroshard writes, in the version it reads:
    one ValueError naming the first thing that is not so."""
    version = manifest.get("version")
    if version != VERSION:
        raise ValueError(f"{where}: manifest version {version!r}; this zeroshard reads version "
                         f"{VERSION} (written by a newer zeroshard, or another program)")
    world = manifest["world"]
    if type(world) is not int or world < 1:
        raise ValueError(f"{where}: world={world!r} is not a number of ranks")
    for key in ("params", "buffers", "files", "extra"):
        if not isinstance(manifest[key], dict):
            raise ValueError(f"{where}: {key} is a {type(manifest[key]).__name__}, not a "
                             "JSON object (damaged, or written by another program)")
    for name, p in manifest["params"].items():
        shape = p.get("shape") if isinstance(p, dict) else None
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"{where}: parameter {name!r} has no shape of sizes >= 0 "
                             "(damaged, or written by another program)")
    for fname, info in manifest["files"].items():
        if Path(fname).name != fname or fname in (".", ".."):
            raise ValueError(f"{where}: file {fname!r} is not in the checkpoint's folder; a "
                             "manifest names its own files only")
        if not isinstance(info, dict) or type(info.get("bytes")) is not int or not isinstance(
                info.get("sha256"), str) or not _rows_ok(info.get("rows")):
            raise ValueError(f"{where}: the entry of {fname!r} lacks its bytes, sha256 or rows "
                             "(damaged, or written by another program)")


def _listed(folder: Path) -> set[str] | None:
    """The names a checkpoint's manifest says its folder holds (itself included), or None
    when ``folder`` has no readable manifest of zeroshard's."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("format") != FORMAT or not isinstance(files, dict):
        return None
    return {MANIFEST, *files}


def pure_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds exactly a checkpoint: its manifest and the files it lists,
    nothing of anyone else's."""
    listed = _listed(folder)
    return (listed is not None and folder.is_dir() and not folder.is_symlink()
            and {p.name for p in folder.iterdir()} <= listed)


def ours_partial(folder: Path) -> bool:
    """Whether ``folder`` (a ``NAME.partial``) is an unfinished save's: a real folder
    holding rank files and at most a manifest."""
    return folder.is_dir() and not folder.is_symlink() and all(
        p.is_file() and (_RANK_FILE.fullmatch(p.name) or p.name == MANIFEST)
        for p in folder.iterdir())


def _pointer_like(path: Path) -> bool:
    """Whether ``path`` is what a save writes as ``latest``: a small file of one name."""
    if not path.is_file() or path.is_symlink() or path.stat().st_size > _POINTER_BYTES:
        return False
    try:
        name = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return False
    return bool(name) and "\n" not in name and "/" not in name and name not in (".", "..")


def _others(folder: Path, listed: set[str] | None) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if listed is None or p.name not in listed)


def _named(names: list[str]) -> str:
    more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


def check_target(path: Path, given: str, whole: bool = True) -> None:
    """Every path a save to ``path`` would replace or remove is a checkpoint's, or absent:
    one ValueError naming the first that is not ([Note: a writer owns only what it
    wrote]). ``given`` leads the line: the argument as the user gave it, which names
    ``path`` itself (``whole``) or the folder ``path`` goes into."""
    head = given if whole else f"{given}: {path}"
    keep = ("; a save replaces only an earlier checkpoint: give a new folder, an empty "
            "one or a checkpoint's")
    if path.name in (LATEST, LATEST + ".partial"):
        raise ValueError(f"{head} is named as the pointer a save writes beside its folder; "
                         "give the checkpoint folder another name")
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise ValueError(f"{head} is a file, not a checkpoint folder{keep}")
    if path.is_dir():
        others = _others(path, _listed(path))
        if others:
            raise ValueError(f"{head} holds {_named(others)}, which no zeroshard checkpoint "
                             f"wrote{keep}")
    beside = {path.with_name(path.name + ".partial"): ours_partial,
              path.with_name(path.name + ".old"): pure_checkpoint,
              path.parent / LATEST: _pointer_like,
              path.parent / (LATEST + ".partial"): _pointer_like}
    for other, is_ours in beside.items():
        if (other.exists() or other.is_symlink()) and not is_ours(other):
            raise ValueError(f"{given}: {other} is in the way and is not what a save leaves "
                             "there (a save writes and replaces it); move it, or save "
                             "elsewhere")
