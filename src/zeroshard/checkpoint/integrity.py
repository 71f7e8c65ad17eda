"""A checkpoint's files checked against its manifest before anything is read from them
(``sharded.py``, [Note: atomicity]): present, of the size and checksum written, holding
the tensors the manifest places in them."""

from __future__ import annotations

from pathlib import Path

from .tensorfile import sha256_file
from .tplayout import saved_local_shape


def verify_contents(ckpt: Path, manifest: dict, fname: str) -> str | None:
    """The first tensor the manifest places in ``fname`` that the file's header lacks or
    shapes otherwise (a checksum says the bytes are the ones written, not that they are
    what the manifest describes), or None."""
    from .tensorfile import TensorFile

    try:
        f = TensorFile(str(ckpt / fname))
    except ValueError as exc:
        return str(exc)
    for name, (a, b) in manifest["files"][fname]["rows"].items():
        want = (b - a, *saved_local_shape(manifest, name)[1:])
        if name not in f.header:
            return f"{ckpt / fname}: no tensor {name!r}, which its manifest lists"
        if f.shape(name) != want:
            return f"{ckpt / fname}: {name!r} has shape {f.shape(name)}, its manifest {want}"
    return None


def verify(ckpt: Path, manifest: dict, needed: set[str]) -> str | None:
    """The first problem with the files in ``needed``, or None."""
    for fname in sorted(needed):
        info = manifest["files"].get(fname)
        p = ckpt / fname
        if info is None:
            return f"{p}: not listed in the manifest"
        if not p.exists():
            return f"{p}: missing"
        if p.stat().st_size != info["bytes"]:
            return f"{p}: {p.stat().st_size} bytes, the manifest says {info['bytes']} (truncated?)"
        if sha256_file(str(p)) != info["sha256"]:
            return f"{p}: checksum mismatch (corrupted)"
    return None
