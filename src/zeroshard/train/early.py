"""torch's launcher started early: ``zeroshard train`` starts ``launch.py`` as soon as it
knows it will launch ranks, before it imports torch itself and checks the flags.

The command's own start (importing torch, the flags, every path checked, the data
tokenized) and the launcher's (a second Python importing torch and its elastic agent)
used to run one after the other, about 5 s and 3 s of a core on a 2-core machine. Here
the launcher imports on another core meanwhile, then waits on a pipe of its own for what
to run (its standard input, and its ranks', stay the command's); the command hands it
over (:func:`take`) once everything is checked. A command that ends before launching (a
bad flag, ``--help``) kills it unused (:func:`discard`): it has done nothing yet but
import.

The early launcher starts with SIGINT ignored (a disposition kept across ``exec``), so a
Ctrl-C before the handover stops the command alone, which then kills it; ``launch.py``
takes SIGINT back when it is handed its run, and from there a Ctrl-C reaches it and the
ranks as before. This module imports nothing heavy: it runs before torch is imported.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import BinaryIO

#: What ``launch.py`` is given on its command line, with the pipe's descriptor, to wait
#: for its run there.
WAIT_FLAG = "--run-from-fd"

_started: tuple[subprocess.Popen, BinaryIO] | None = None  # the launcher, its pipe


def on_a_rank() -> bool:
    """Whether this process is a rank of a job (torchrun's, or ``launch``'s)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def start(argv: list[str]) -> None:
    """Start the launcher for ``zeroshard train`` ``argv`` if this command will launch
    ranks: not on a rank (torchrun's or the launcher's own), not asking for help, and
    called on the main thread (where a signal disposition can be set). Its run comes
    through a pipe of its own, so its standard input (and the ranks') stays the
    command's."""
    global _started
    if (_started is not None or on_a_rank() or {"-h", "--help"} & set(argv)
            or threading.current_thread() is not threading.main_thread()):
        return
    read, write = os.pipe()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the child
    try:
        proc = subprocess.Popen([sys.executable, "-m", "zeroshard.train.launch", WAIT_FLAG,
                                 str(read)], pass_fds=(read,))
        _started = (proc, os.fdopen(write, "wb"))
    except OSError:  # launched the usual way, later
        os.close(write)
    finally:
        signal.signal(signal.SIGINT, old)
        os.close(read)


def take(argv: list[str], env: dict[str, str]) -> subprocess.Popen | None:
    """The early launcher, handed ``launch.py``'s ``argv`` and the environment its ranks
    get; None when none was started (or it has died), and the caller starts one."""
    global _started
    started, _started = _started, None
    if started is None:
        return None
    proc, pipe = started
    try:
        with pipe:
            pipe.write(json.dumps({"argv": argv, "env": env}).encode())
    except OSError:  # it died before the handover: start another
        proc.kill()
        proc.wait()
        return None
    return proc


def discard() -> None:
    """Kill an early launcher that was never handed a run (the command ended first)."""
    global _started
    started, _started = _started, None
    if started is not None:
        proc, pipe = started
        proc.kill()
        proc.wait()
        pipe.close()


def wait_for_run(fd: int) -> tuple[list[str], dict[str, str]] | None:
    """In ``launch.py`` started early: its ``argv`` and environment, once handed over
    through pipe ``fd``; None at its end with nothing (the command ended first)."""
    with os.fdopen(fd, "rb") as pipe:
        data = pipe.read()
    if not data:
        return None
    run = json.loads(data)
    return run["argv"], run["env"]
