"""A checkpoint folder believed only once it is what zeroshard writes.

A ``latest`` pointer and a ``manifest.json`` are plain files: another program (or an
edit, or a newer zeroshard) may have written them. Before anything is read on their
word, the pointer must name a folder beside it, and the manifest must be of the version
this zeroshard reads and of the shape it writes, its files inside the checkpoint folder
(``../../x`` in a manifest would have been read, and checksummed, wherever it led).
"""

from __future__ import annotations

from pathlib import Path

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
