"""Reading a JSON object from a file, with errors that name the file and the problem."""

from __future__ import annotations

import json
from pathlib import Path


class _Twice(ValueError):
    """A key given twice in one JSON object."""


def _once(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are each given once: JSON parsers keep the last of a key
    given twice without a word, so a setting written twice would silently take one."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _Twice(key)
        out[key] = value
    return out


def read_json_object(path: str | Path, what: str = "") -> dict:
    """The JSON object in ``path``; a ValueError names the file and what is wrong (a key
    given twice included)."""
    label = f"{what} {path}".strip()
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"), object_pairs_hook=_once)
    except _Twice as exc:
        raise ValueError(f"{label}: the key {exc.args[0]!r} is given twice in one object; "
                         "give it once") from None
    except OSError as exc:
        raise ValueError(f"cannot read {label}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{label} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{label}: expected a JSON object, got {type(data).__name__}")
    return data
