"""A bad setting of ``zeroshard train`` told in the words the user typed.

``TrainConfig`` and the checks before launch name a setting as its field
(``micro_batch=3 does not divide ...``): the library's name, which is also the key of a
``--config`` file. On the command line the user typed a flag, so the line names the
flag (``--micro-batch=3 does not divide ...``), and a setting that came from the
``--config`` file keeps its key, with the file named first (``config FILE:
steps=2.5 must be an integer``). Settings given nowhere are named as flags: that is how
the user would give them.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import fields
from pathlib import Path

from .settings import TrainConfig, engine_keys

#: Settings that are not ``TrainConfig`` fields but whose flag tells the same value.
_ALIASES = {"precision": "mixed_precision"}


def flag(name: str) -> str:
    """The flag of setting ``name`` (``micro_batch``: ``--micro-batch``)."""
    return "--" + name.replace("_", "-")


def _settings() -> list[str]:
    names = [f.name for f in fields(TrainConfig) if f.name != "zero"] + engine_keys()
    return sorted(set(names), key=len, reverse=True)


def _config_keys(path: str | None) -> set[str]:
    """The keys of the ``--config`` file at top level and under "zero" (aliases as the
    settings they stand for); empty when it cannot be read (its own error says why)."""
    if not path:
        return set()
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    if not isinstance(data, dict):
        return set()
    nested = data.get("zero") if isinstance(data.get("zero"), dict) else {}
    return {_ALIASES.get(k, k) for k in [*data, *nested] if isinstance(k, str)}


def in_user_words(message: str, typed: set[str], config: str | None) -> str:
    """``message`` with each setting it names as the user gave it: the flag, or the key of
    the ``--config`` file (whose path then leads the line) when it came from there."""
    if message.startswith("config "):
        return message  # about the --config file itself, in its keys
    from_file = _config_keys(config) - typed
    names = "|".join(map(re.escape, _settings()))
    # a setting's name as a word of its own: before "=" (name=value), or, for a name
    # with an underscore (no English word has one), anywhere; not inside a quoted
    # value, a path or a dotted key (zero_optimization.stage)
    pattern = re.compile(rf"(?<![\w.\-/'\"])({names})(?=(=|[^\w\-=]|$))")
    mentioned = set()

    def spell(m: re.Match) -> str:
        name = m.group(1)
        if m.group(2) != "=" and "_" not in name:
            return name  # a plain word of the sentence ("the model", "profile:")
        mentioned.add(name)
        return name if name in from_file else flag(name)

    out = pattern.sub(spell, message)
    keys = re.findall(r"(?<![\w.\-/'\"])([a-z][a-z0-9_]*)(?=[=.])", message)
    if config and not out.startswith("config ") and (
            mentioned & from_file or any(k in from_file for k in keys)):
        out = f"config {config}: {out}"
    return out


@contextlib.contextmanager
def named(args):
    """Run ``zeroshard train``'s command with its bad input (ValueError, and the
    NotImplementedError of a valid request not supported) told in the user's words."""
    typed = {k for k, v in vars(args).items() if v is not None and not k.startswith("_")}
    try:
        yield
    except (ValueError, NotImplementedError) as exc:
        exc.args = (in_user_words(str(exc), typed, getattr(args, "config", None)),)
        raise
