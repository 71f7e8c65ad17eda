"""The arguments of ``zs.save``, ``zs.load`` and ``zs.load_pretrained``, checked before
anything is read or written.

These are collective calls: every rank enters them, and a rank that raises alone leaves
the others waiting in the next collective until the timeout. So what can differ between
ranks (``extra``, which only rank 0 writes) is agreed: every rank raises the same
error at once. ``extra`` goes into the manifest as JSON; a tensor there (an RNG state,
typically) used to fail on rank 0 alone, after the rank files were written.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from .sanity import check_target

_JSON = (str, int, float, bool, type(None))


def _what(value) -> str:
    return type(value).__name__ if not torch.is_tensor(value) else "torch.Tensor"


def _not_json(value, where: str) -> str | None:
    """Where ``value`` holds something JSON cannot, and what it is; None if nothing."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return (f"{where} has the key {k!r} ({type(k).__name__}); JSON keys are "
                        f"strings: it would load back as {str(k)!r}")
            found = _not_json(v, f"{where}[{k!r}]")
            if found:
                return found
        return None
    if isinstance(value, (list, tuple)):
        return next((f for i, v in enumerate(value) if (f := _not_json(v, f"{where}[{i}]"))),
                    None)
    if isinstance(value, _JSON):
        return None
    hint = ("zs.save already keeps every rank's torch RNG state and zs.load restores it; "
            "for another tensor give its .tolist()" if torch.is_tensor(value) else
            "give numbers, strings, lists and dicts")
    return f"{where} is a {_what(value)}, which the manifest (JSON) cannot hold: {hint}"


def path_given(path, call: str, what: str = "a checkpoint folder") -> Path:
    """``path`` as a Path: an empty one (an unset variable) is not the current folder."""
    if not isinstance(path, (str, Path)) or not str(path).strip():
        raise ValueError(f"{call}: path={path!r}; expected the path of {what}")
    return Path(path)


def sharded_model(model, call: str) -> None:
    """``model`` is what ``zs.shard`` returned."""
    if not hasattr(model, "mesh") or not hasattr(model, "units"):
        raise ValueError(f"{call} takes the model zs.shard returned; got {_what(model)}")


def said(exc: Exception, where: Path) -> str:
    """One rank's error inside a save as the problem every rank is told: the file and the
    OS's words, or the error's type and message."""
    if isinstance(exc, OSError):
        return f"{exc.filename or where}: {exc.strerror or exc}"
    return f"{where}: {type(exc).__name__}: {exc}"


def check_save(model, optimizer, path, extra) -> None:
    """``zs.save``'s arguments, ``extra`` agreed by every rank before anything is written."""
    sharded_model(model, "zs.save()")
    path_given(path, "zs.save()")
    given = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    bad = next((o for o in given if o is not None and not hasattr(o, "param_groups")), None)
    if bad is not None or (isinstance(optimizer, (list, tuple)) and None in given):
        raise ValueError(f"zs.save(): optimizer={_what(bad or optimizer)}; expected a torch "
                         "optimizer of the model's parameters, a list of them (Muon beside "
                         "AdamW), or None")
    problems = [None] * model.mesh.dp_world
    dist.all_gather_object(problems, _save_problem(path, extra), group=model.mesh.dp_group)
    first = next((p for p in problems if p), None)
    if first:
        raise ValueError(first)


def _save_problem(path, extra) -> str | None:
    """What this rank finds wrong with a save to ``path`` of ``extra``: a path the save
    would replace that is not a checkpoint's (``sanity.check_target``), or an ``extra``
    the manifest cannot hold; None if nothing."""
    try:
        check_target(Path(path), f"zs.save(): path={str(path)!r}")
    except ValueError as exc:
        return str(exc)
    if extra is not None and not isinstance(extra, dict):
        return f"zs.save(): extra is a {_what(extra)}; expected a dict (JSON) or None"
    found = _not_json(extra, "extra") if extra is not None else None
    return found and f"zs.save(): {found}"
