"""A DeepSpeed ZeRO checkpoint written as a zeroshard checkpoint, streaming.

Every output tensor (rows [r·c, r·c + c) of one parameter, or of one of its Adam
moments, for output file r) is gathered from the DeepSpeed rank files' pieces of it when
``write_tensors`` asks for it, written, and dropped: the host holds one such tensor at a
time — at most the largest parameter, in fp32 — whatever the model's size and the number
of rank files (``zero_to_fp32`` holds every rank's flat partitions at once). Besides,
the files' structure stays in memory: per parameter and state, one (tensor, range) per
rank file that holds part of it.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from ..sanity import ours_partial
from ..sharded import FORMAT, move_in, own_rows
from ..tensorfile import write_tensors
from .pieces import gather, scalar
from .structure import Checkpoint, read

#: the recipe a DeepSpeed run of each compute dtype with Adam state corresponds to
_RECIPES = {torch.float32: "fp32-adamw", torch.bfloat16: "bf16-mixed-adamw",
            torch.float16: "fp16-mixed-adamw"}


def import_deepspeed(src: str | Path, out: str | Path, tag: str | None = None,
                     world: int | None = None) -> dict:
    """Write the DeepSpeed ZeRO-1/2/3 checkpoint at ``src`` (``latest``'s tag, or ``tag``)
    to ``out`` as a zeroshard checkpoint: fp32 master weights, every optimizer state
    (Adam's moments and step), param-group settings, buffers; ``extra`` holds
    ``{"step": global_steps, "deepspeed": {...}}``. ``world`` is the number of rank files
    to write (default: the DeepSpeed run's N); ``zs.load`` reads it at any N and stage.
    ``out`` must not exist or be empty; it appears complete or not at all.
    Returns the manifest."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"out={str(out)!r} exists and is not empty; give a new folder")
    partial = out.with_name(out.name + ".partial")
    if partial.exists() or partial.is_symlink():
        if not ours_partial(partial):  # [Note: a writer owns only what it wrote]
            raise ValueError(f"out={str(out)!r}: {partial} is in the way and is not what an "
                             "import leaves there; move it, or import elsewhere")
        shutil.rmtree(partial)  # what an import stopped by a kill left
    if world is not None and (isinstance(world, bool) or not isinstance(world, int)
                              or world < 1):
        raise ValueError(f"world={world!r}: expected a number of rank files >= 1")
    ck = read(src, tag)
    world = world or ck.world
    partial.mkdir(parents=True)
    try:
        files = [_write_rank(ck, partial, r, world) for r in range(world)]
        manifest = _manifest(ck, world, files)
        move_in(partial, out, manifest)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return manifest


def _write_rank(ck: Checkpoint, partial: Path, rank: int, world: int) -> dict:
    """Output file ``rank``: its rows of every parameter and of its optimizer state, as
    ``zs.save`` lays them out (``sharded._write_rows``), and (rank 0) the buffers."""
    plan, rows = [], {}
    for p in ck.params:
        a, b = own_rows(p.shape[0] if p.shape else 1, rank, world)
        if a == b:
            continue
        rows[p.name] = [a, b]
        row = math.prod(p.shape[1:])
        shape = (b - a, *p.shape[1:])
        for key, pieces in p.pieces.items():
            plan.append((f"{p.name}::{key}" if key else p.name, shape, pieces[0][0].dtype,
                         lambda pieces=pieces, a=a, b=b, row=row, shape=shape:
                         gather(pieces, a * row, b * row).reshape(shape)))
        for key, value in p.scalars.items():
            t = scalar(value)
            plan.append((f"{p.name}::{key}", (), t.dtype, lambda t=t: t))
    if rank == 0:
        for name, t in ck.buffers.items():
            plan.append((f"{name}::buffer", t.shape, t.dtype, t.load))
    fname = f"rank{rank:05d}.safetensors"
    sha, size = write_tensors(str(partial / fname), plan, {"rows": json.dumps(rows)})
    return {"file": fname, "sha256": sha, "bytes": size, "rows": rows}


def _manifest(ck: Checkpoint, world: int, files: list[dict]) -> dict:
    adam = any("exp_avg_sq" in p.pieces for p in ck.params)
    dtype = str(ck.compute_dtype)[6:]
    return {
        "format": FORMAT, "version": 1, "world": world, "stage": ck.zero_stage,
        "recipe": _RECIPES.get(ck.compute_dtype) if adam else f"deepspeed-{dtype}",
        "params": {p.name: {"shape": list(p.shape), "dtype": str(p.pieces[""][0][0].dtype)[6:],
                            "trainable": p.trainable} for p in ck.params},
        "buffers": {n: list(t.shape) for n, t in ck.buffers.items()},
        "nonpersistent": [],  # DeepSpeed saves persistent buffers only
        # the class is not in DeepSpeed's files; the loader checks the groups' names
        "optimizer": {"class": "AdamW" if adam else "unknown", "param_groups": ck.groups},
        "files": {f["file"]: {k: f[k] for k in ("sha256", "bytes", "rows")} for f in files},
        "extra": {"step": ck.global_steps,
                  "deepspeed": {"folder": str(ck.folder.resolve()), "version": ck.ds_version,
                                "stage": ck.zero_stage, "world": ck.world}},
    }
