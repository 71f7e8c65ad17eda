"""zeroshard inspect — what a sharded checkpoint holds, and whether its files are intact."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from ..checkpoint.sharded import read_manifest, resolve, verify, verify_contents


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help="a checkpoint directory, or a save directory with `latest`")


def run(args) -> int:
    ckpt = resolve(args.ckpt)
    m = read_manifest(ckpt)
    params = sum(_numel(p["shape"]) for p in m["params"].values())
    console = Console(highlight=False, width=max(Console().width, 120))
    tp = m.get("tp", 1)  # tensor parallelism: T x N files, split tensors by tp rank
    split = sum("tp" in p for p in m["params"].values())
    tp_text = f", TP {tp} ({split} tensors split)" if tp > 1 else ""
    console.print(f"{ckpt}: step {m['extra'].get('step', '?')}, N = {m['world']}{tp_text}, "
                  f"ZeRO stage "
                  f"{m['stage']}, recipe {m['recipe']}, {params:,} parameters in "
                  f"{len(m['params'])} tensors")
    t = Table(title="files", title_justify="left")
    for col in ("file", "bytes", "checksum"):
        t.add_column(col, justify="left" if col != "bytes" else "right")
    bad = 0
    for fname, info in sorted(m["files"].items()):
        problem = verify(ckpt, m, {fname}) or verify_contents(ckpt, m, fname)
        bad += problem is not None
        t.add_row(fname, f"{info['bytes']:,}", "ok" if problem is None else problem)
    console.print(t)
    return 1 if bad else 0


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
