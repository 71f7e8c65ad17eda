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
import re
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

LOCK = ".zeroshard-lock"


def checkpoint_bytes(params: int, recipe) -> int:
    """Bytes of one checkpoint of ``params`` parameters: the fp32 master rows (the
    weights themselves without a master) and the optimizer state, as ``save`` writes."""
    master = recipe.master_bytes or recipe.weight_bytes
    return params * (master + recipe.optimizer_bytes - recipe.master_bytes)


def check(path: str | Path, need: int, due: Callable[[int], bool] = lambda step: False,
          last: int = 0) -> None:
    """``path`` can be created, written, and holds ``need`` free bytes; the checkpoints
    the run will save there (its last step ``last`` and every step before it ``due``
    says) replace only what saves wrote ([Note: a writer owns only what it wrote] in
    ``sanity.py``)."""
    from .._paths import folder
    from .sanity import check_target

    path = Path(path)
    folder("save_dir", path)
    steps = {last} | {int(m.group(1)) for e in path.iterdir()
                      if (m := re.fullmatch(r"step-(\d{6,})(\.partial|\.old)?", e.name))
                      and int(m.group(1)) <= last and due(int(m.group(1)))}
    for step in sorted(steps):
        check_target(path / f"step-{step:06d}", f"save_dir={str(path)!r}", whole=False)
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
    other folders, and step folders holding anything besides their checkpoint, are not
    the trainer's to remove. Returns those removed."""
    from .sanity import MANIFEST, pure_checkpoint
    from .sharded import resolve

    path = Path(path)
    # a step folder that holds anything besides its checkpoint is not the trainer's alone
    saved = sorted((c for c in path.glob("step-*") if c.name[5:].isdigit()
                    and pure_checkpoint(c)),
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
