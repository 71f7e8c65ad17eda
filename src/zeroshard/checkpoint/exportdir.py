"""An export's files put into their folder whole: written aside, then moved in, with
whatever an earlier export left there that the new one does not have removed.

A reader (``load_pretrained``, ``from_pretrained``) takes ``model.safetensors.index.json``
when there is one, else ``model.safetensors``. An export that failed half-way used to
leave 2 of 4 shards and no index; one into a folder that held an older sharded export
left the old index beside the new ``model.safetensors``, so the *old* weights were
loaded. Here every file is written under a hidden ``.NAME.partial`` name first (a
failure removes them and leaves the folder as it was), then moved in by renames, in an
order under which a reader stopped at any moment finds either the complete old export,
no export at all (a clear error), or the complete new one, never a mixture: a single
file replaces ``model.safetensors`` and then the stale index goes; shards go in only
after the old index (and any ``model.safetensors``) has gone, and the new index last.
The folder's other files are left alone, and a file the export would replace or remove
must be one an export wrote ([Note: a writer owns only what it wrote] in
``sanity.py``): the folder's record (``zeroshard._paths.RECORD``) lists them, and a
``model.safetensors`` of the user's own (say, the model the run started from) is
refused by name before anything is read.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from .._paths import claim, folder, record
from .tensorfile import fsync_dir

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


#: The names of a weights export, which a new one replaces or removes.
WEIGHTS = (re.escape(SINGLE), re.escape(INDEX), _SHARD.pattern)


def _ours(path: Path) -> list[Path]:
    """The export files in ``path``: the single file, shards and the index."""
    return [p for p in path.iterdir()
            if p.name in (SINGLE, INDEX) or _SHARD.fullmatch(p.name)]


def check(out: str | Path, names=(), weights: bool = True) -> Path:
    """``out`` can take the export (a folder, made if missing, that takes writes), and
    what it would replace there — ``names``, and with ``weights`` an earlier export's
    weights — an export wrote; found before the checkpoint is read."""
    folder("out", out)
    claim("out", out, names, WEIGHTS if weights else ())
    return Path(out)


def put(out: Path, name: str, write_to: Callable[[Path], None]) -> None:
    """One file ``name`` written aside and moved into ``out`` whole, recorded as the
    export's (``check`` claimed it first)."""
    tmp = out / f".{name}.partial"
    write_to(tmp)
    os.replace(tmp, out / name)
    record(out, [name])


def write(out: Path, files: list[tuple[str, Callable[[Path], None]]]) -> None:
    """Write ``files`` ((name, write(path))) into ``out`` whole, replacing the export that
    is there. A failure leaves ``out`` as it was and raises a ValueError saying so."""
    check(out)
    for stale in out.glob(".model*.partial"):  # from an export that was stopped
        if any(re.fullmatch(w, stale.name[1:-len(".partial")]) for w in WEIGHTS):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale)
            else:
                stale.unlink(missing_ok=True)
    aside = []
    try:
        for name, write_to in files:
            tmp = out / f".{name}.partial"
            aside.append(tmp)
            write_to(tmp)
    except BaseException as exc:  # a full disk, a damaged checkpoint, Ctrl-C: nothing stays
        for tmp in aside:
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise ValueError(f"export not written: {exc.filename or out}: "
                             f"{exc.strerror or exc}; {out} is as it was") from None
        raise
    names = [name for name, _ in files]
    old = _ours(out)
    if INDEX in names:  # shards: the old export goes before any new shard is visible
        for p in old:
            if p.name in (INDEX, SINGLE):
                p.unlink()
        for name in names:
            if name != INDEX:
                os.replace(out / f".{name}.partial", out / name)
        os.replace(out / f".{INDEX}.partial", out / INDEX)  # the new export, at once
    else:  # one file: replaced at once; a stale index would still win, so it goes next
        os.replace(out / f".{SINGLE}.partial", out / SINGLE)
        (out / INDEX).unlink(missing_ok=True)
    for p in old:
        if p.name not in names and p.exists():
            p.unlink()
    record(out, names, gone=[p.name for p in old])
    fsync_dir(str(out))
