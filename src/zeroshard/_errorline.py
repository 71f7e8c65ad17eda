"""An error as the command line tells it: one line and an exit code.

``zeroshard.cli`` tells a command's errors this way, and the ranks of ``zeroshard
train`` tell theirs the same way (``train/failure.py``), so both import it from here
rather than the trainer importing the command line. Pure Python: ``zeroshard plan``
never imports torch.
"""

from __future__ import annotations

import os
import re
import unicodedata

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


#: A quoted value longer than this is cut in an error line (a pasted file, a runaway
#: variable): its start and its length tell it.
LONGEST = 200

_QUOTED = re.compile(r"'([^'\n]*)'")


def told_plainly(message: str) -> str:
    """``message`` as an error line tells it: a quoted value of more than ``LONGEST``
    characters cut, and a value whose letters are not all ASCII said to be so (``tіny``
    with a Cyrillic ``і`` prints as ``tiny`` does, and matches nothing)."""
    def cut(m: re.Match) -> str:
        text = m.group(1)
        if len(text) <= LONGEST:
            return m.group(0)
        return f"'{text[:60]}…' ({len(text):,} characters)"

    message = _QUOTED.sub(cut, message)
    if "non-ASCII" in message:
        return message
    for m in _QUOTED.finditer(message):
        odd = [c for c in m.group(1) if ord(c) > 127 and unicodedata.category(c)[0] in "LN"]
        if odd:
            name = unicodedata.name(odd[0], "an unnamed character")
            return (f"{message} ('{m.group(1)}' has a non-ASCII letter: {odd[0]!r}, "
                    f"U+{ord(odd[0]):04X} {name})")
    return message


def line_of(exc: BaseException, command: str) -> tuple[str, int]:
    """The one line ``command`` prints for ``exc``, and its exit code: 2 for bad input and
    unsupported requests, 1 otherwise."""
    kind = type(exc).__name__
    own = getattr(exc, "one_line", None)  # an error that can say itself in one line
    message = told_plainly(" ".join((own() if callable(own) else str(exc)).split()) or kind)
    if isinstance(exc, ValueError):
        return f"{command}: error: {message}", 2
    if isinstance(exc, NotImplementedError):
        return f"{command}: not supported: {message}", 2
    if isinstance(exc, OSError) and exc.strerror:  # a path the command could not use
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{command}: error: {where}{exc.strerror}", 1
    hint = "" if kind in _TOLD else f" ({DEBUG}=1 for the full trace)"
    return f"{command}: error: {kind}: {message}{hint}", 1
