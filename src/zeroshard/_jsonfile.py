"""Reading a JSON object from a file, with errors that name the file and the problem."""

from __future__ import annotations

import json
from pathlib import Path


def read_json_object(path: str | Path, what: str = "") -> dict:
    """The JSON object in ``path``; a ValueError names the file and what is wrong."""
    label = f"{what} {path}".strip()
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read {label}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{label} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{label}: expected a JSON object, got {type(data).__name__}")
    return data
