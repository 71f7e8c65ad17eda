"""A run's save folder, checked before the first step and held for the run.

A read-only or full folder used to lose a run at its first save, after every step of
it had been trained; two runs on one folder replaced each other's checkpoints without a
word. So before anything starts the folder must be writable and have room for a
checkpoint beside the last one (an overwrite writes the new copy before it drops the
old), and a lock file names the run that holds the folder: a second run is refused by
name while the first lives.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from pathlib import Path

LOCK = ".zeroshard-lock"


def checkpoint_bytes(params: int, recipe) -> int:
    """Bytes of one checkpoint of ``params`` parameters: the fp32 master rows (the
    weights themselves without a master) and the optimizer state, as ``save`` writes."""
    master = recipe.master_bytes or recipe.weight_bytes
    return params * (master + recipe.optimizer_bytes - recipe.master_bytes)


def check(path: str | Path, need: int) -> None:
    """``path`` can be created, written, and holds ``need`` free bytes."""
    from .._paths import folder

    path = Path(path)
    folder("save_dir", path)
    free = shutil.disk_usage(path).free
    if free < need:
        raise ValueError(f"save_dir={str(path)!r} has {free / 1e9:.2f} GB free; a checkpoint "
                         f"beside the last one needs {need / 1e9:.2f} GB")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def hold(path: str | Path):
    """Hold ``path`` for this run: refuse it while another live run holds it (a lock left
    by a run that died on this host is taken over)."""
    lock = Path(path) / LOCK
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            try:
                other = json.loads(lock.read_text())
            except (OSError, ValueError):
                other = {}
            if other.get("host") == me["host"] and not _alive(int(other.get("pid", 0))):
                lock.unlink(missing_ok=True)  # stale: its run is gone
                continue
            raise ValueError(
                f"save_dir={str(path)!r} is held by another run (pid {other.get('pid', '?')} "
                f"on {other.get('host', '?')}, started {other.get('started', '?')}): give "
                f"this run its own --save-dir, or remove {lock} if that run is gone") from None
    with os.fdopen(fd, "w") as fh:
        json.dump(me, fh)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def prune(path: str | Path, keep: int) -> list[Path]:
    """Remove all but the ``keep`` trainer checkpoints (``step-NNNNNN``) saved last in
    ``path`` (by when their manifest was written, so a run resumed from an older step
    keeps what it saved, not the highest step numbers), never the one ``latest`` names;
    other folders are not the trainer's to remove. Returns those removed."""
    from .sharded import MANIFEST, resolve

    path = Path(path)
    saved = sorted((c for c in path.glob("step-*") if c.name[5:].isdigit() and c.is_dir()
                    and (c / MANIFEST).is_file()),
                   key=lambda c: ((c / MANIFEST).stat().st_mtime_ns, c.name), reverse=True)
    try:
        latest = resolve(path).resolve()
    except ValueError:
        latest = None
    removed = []
    for ckpt in saved[keep:]:
        if ckpt.resolve() != latest:
            shutil.rmtree(ckpt, ignore_errors=True)
            removed.append(ckpt)
    return removed
