"""A rank's error, told once: the ranks of ``zeroshard train`` write it, the launcher
prints it.

Ranks usually fail together and alike (loading, saving and the engine's checks agree
across ranks before they raise), so N ranks printing the same error, followed by
torch's launcher's ``ChildFailedError`` report of some 40 lines, bury the one line
that matters. Under ``zeroshard train`` each failing rank writes its error, already
formatted as the command's one line, into a folder the launcher names
(``ZEROSHARD_ERROR_DIR``) and prints nothing; the launcher prints the line of the
rank that failed first, once, and exits with its code. ``--debug`` (or
``ZEROSHARD_DEBUG=1``) keeps every rank's traceback and the launcher's own report.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from .._errorline import DEBUG, debugging
from .._errorline import line_of as _command_line_of

ERROR_DIR = "ZEROSHARD_ERROR_DIR"


def line_of(exc: BaseException) -> tuple[str, int]:
    """``zeroshard train``'s one line for ``exc`` and its exit code."""
    return _command_line_of(exc, "zeroshard train")


def record(exc: BaseException, rank: int) -> int:
    """On a rank started by the launcher: write ``exc``'s line for the launcher (and,
    when debugging, the traceback to stderr); return the exit code. Elsewhere (plain
    torchrun) the line goes to stderr, prefixed by the rank."""
    line, code = line_of(exc)
    if debugging():
        traceback.print_exception(exc)
    folder = os.environ.get(ERROR_DIR)
    if folder and Path(folder).is_dir():
        tmp = Path(folder) / f".rank{rank}.json"
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)  # --max-restarts
        tmp.write_text(json.dumps({"rank": rank, "line": line, "code": code,
                                   "attempt": attempt}))
        os.replace(tmp, Path(folder) / f"rank{rank}.json")  # whole, or not there at all
    else:
        sys.stderr.write(f"[rank {rank}] {line}\n")
    return code


def recorded(folder: str | Path) -> dict[int, dict]:
    """The errors the ranks of the last attempt that wrote any wrote into ``folder``, by
    rank (an attempt restarted by ``--max-restarts`` leaves its ranks' errors behind)."""
    out = {}
    for path in Path(folder).glob("rank*.json"):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[int(entry["rank"])] = entry
    last = max((e.get("attempt", 0) for e in out.values()), default=0)
    return {r: e for r, e in out.items() if e.get("attempt", 0) == last}


def incurable(folder: str | Path) -> dict | None:
    """The record of the latest attempt's rank whose error no restart can cure — bad
    input or a refused combination (exit code 2: the same settings meet it again) — or
    None when every failure may pass (a rank that died, a collective that timed out, a
    fault: code 1)."""
    lines = recorded(folder)
    return next((lines[r] for r in sorted(lines) if int(lines[r]["code"]) == 2), None)


def told(folder: str | Path, failures: dict[int, tuple[int, str]], first: int) -> tuple[str, int]:
    """The launcher's line and exit code for a failed run (``failures``: rank -> (exit
    code, signal name or "")): a rank's own error whose message is the whole story;
    else a rank killed by a signal it did not send itself, first (the others' errors then
    only say they lost it, like gloo's "Connection reset by peer"), the rank the launcher
    saw fail first preferred, and SIGTERM last (the launcher sends it to the rest);
    else a rank's unexpected error; else what the launcher saw."""
    lines = recorded(folder)
    whole = {r: e for r, e in lines.items() if DEBUG not in e["line"]}
    if whole:
        rank = min(whole, key=lambda r: (r != first, r))
        return whole[rank]["line"], int(whole[rank]["code"])
    killed = [r for r, (code, signal) in failures.items() if signal and r not in lines]
    if killed:
        rank = min(killed, key=lambda r: (failures[r][1] == "SIGTERM", r != first, r))
        others = sorted((set(lines) | set(failures)) - {rank})
        after = (f"; {'rank' if len(others) == 1 else 'ranks'} "
                 f"{', '.join(map(str, others))} then stopped, having lost it") if others else ""
        return (f"zeroshard train: error: rank {rank} was killed by {failures[rank][1]} "
                f"without an error of its own (out of memory, or killed from outside?){after}"
                f"; --debug or {DEBUG}=1 for every rank's traceback and the launcher's "
                "report"), 1
    if lines:
        rank = min(lines, key=lambda r: (r != first, r))
        return lines[rank]["line"], int(lines[rank]["code"])
    code, signal = failures[first]
    how = f"was killed by {signal}" if signal else f"exited with code {code}"
    return (f"zeroshard train: error: rank {first} {how} without an error of its own "
            f"(out of memory, or killed from outside?); --debug or {DEBUG}=1 for the "
            "launcher's report"), 1
