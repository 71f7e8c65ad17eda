"""An error as the command line tells it: one line and an exit code.

``zeroshard.cli`` tells a command's errors this way, and the ranks of ``zeroshard
train`` tell theirs the same way (``train/failure.py``), so both import it from here
rather than the trainer importing the command line. Pure Python: ``zeroshard plan``
never imports torch.
"""

from __future__ import annotations

import os

#: Set (to anything but 0) to see the full traceback of an error instead of its line.
DEBUG = "ZEROSHARD_DEBUG"

#: Errors whose message is the whole story: the user's input (ValueError), a valid
#: request not supported (NotImplementedError), and the faults every rank meets alike
#: (docs/faults.md). Any other type is unexpected; its line says how to see the trace.
_TOLD = ("ValueError", "NotImplementedError", "SaveFailed", "FloatingPointError",
         "NonFiniteGradients", "RanksOutOfStep", "CollectiveTimeout")


def debugging() -> bool:
    """Whether full traces are wanted (``zeroshard train --debug`` sets the variable)."""
    return os.environ.get(DEBUG, "") not in ("", "0")


def line_of(exc: BaseException, command: str) -> tuple[str, int]:
    """The one line ``command`` prints for ``exc``, and its exit code: 2 for bad input and
    unsupported requests, 1 otherwise."""
    kind = type(exc).__name__
    message = str(exc).strip() or kind
    if isinstance(exc, ValueError):
        return f"{command}: error: {message}", 2
    if isinstance(exc, NotImplementedError):
        return f"{command}: not supported: {message}", 2
    if isinstance(exc, OSError) and exc.strerror:  # a path the command could not use
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{command}: error: {where}{exc.strerror}", 1
    hint = "" if kind in _TOLD else f" ({DEBUG}=1 for the full trace)"
    return f"{command}: error: {kind}: {message}{hint}", 1
