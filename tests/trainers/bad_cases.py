"""The rows of docs/bad-inputs.md's trainers section, run in a process group of one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from . import lightning_cases as lc
from . import models as m

#: The section of docs/bad-inputs.md whose rows are these cases.
SECTION = "zeroshard.hf and zeroshard.lightning"
DOC = Path(__file__).resolve().parents[2] / "docs" / "bad-inputs.md"


def rows() -> list[tuple[str, str]]:
    """(input, line) for every row of the section: its first cell is ``hf: `code```."""
    out, inside = [], False
    for raw in DOC.read_text(encoding="utf-8").splitlines():
        if raw.startswith("## "):
            inside = raw[3:].strip() == SECTION
        elif inside and raw.startswith(("| hf: `", "| lightning: `")):
            first, line = (c.strip().replace("\\|", "|")
                           for c in re.split(r"(?<!\\)\|", raw)[1:3])
            out.append((first.split(": `", 1)[1].removesuffix("`"), line.strip("`")))
    return out


def namespace(folder: str) -> dict:
    """What a row's code may name: the Trainer, TrainingArguments with the tests'
    defaults (``args(...)``), a tiny Llama (``model()``), its data, Lightning's Trainer
    over the tests' LightningModule (``fit(strategy, ...)``)."""
    import lightning.pytorch as pl

    import zeroshard as zs
    from zeroshard.hf import Trainer, sharded
    from zeroshard.lightning import ZeroShardStrategy

    def fit(strategy, **kw):
        lc.fit(strategy, folder, **{"max_epochs": 1, **kw})

    Path(folder, "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    return {"Trainer": Trainer, "sharded": sharded, "zs": zs, "torch": torch, "pl": pl,
            "ZeroShardStrategy": ZeroShardStrategy, "model": m.llama, "data": m.data(),
            "args": lambda **kw: m.args(folder, **kw), "fit": fit, "tmp": folder}


def run_rows(folder: str, cases: list[tuple[str, str]]) -> list[str]:
    """Each row's exception as ``Type: message`` (or ``no error``)."""
    m.join_world()
    space = namespace(folder)
    got = []
    for code, _ in cases:
        try:
            exec(code.replace("{tmp}", folder), dict(space))
            got.append("no error")
        except Exception as exc:  # noqa: BLE001 - the type is part of the line
            got.append(f"{type(exc).__name__}: {exc}")
    return got
