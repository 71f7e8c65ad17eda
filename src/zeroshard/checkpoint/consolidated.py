"""Consolidated (unsharded) safetensors: export a sharded checkpoint, one parameter at a
time, in the Hugging Face layout; and initialise a sharded model from one, each rank
reading only the rows it keeps."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..runtime.dist import TORCH_DTYPES
from .arguments import path_given, sharded_model
from .exportdir import INDEX, SINGLE
from .exportdir import check as check_out_dir
from .exportdir import write as write_out_dir
from .load import _agree, base_model
from .sharded import entries, read_manifest, resolve, verify
from .tensorfile import TensorFile, write_tensors
from .tplayout import pieces, place, read_whole


def export(ckpt_path: str | Path, out_dir: str | Path, dtype: str = "fp32",
           max_shard_bytes: int = 5 * 10**9) -> dict:
    """Write ``out_dir/model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` files
    of at most ``max_shard_bytes`` and an index) from a sharded checkpoint, holding one
    parameter in memory at a time. Returns {file: [names]}."""
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype={dtype!r}; expected 'fp32' or 'bf16'")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    made = not Path(out_dir).exists()
    out_dir = check_out_dir(out_dir)  # before anything is read
    try:
        return _export(ckpt_path, out_dir, dtype, max_shard_bytes)
    except BaseException:
        if made and not any(out_dir.iterdir()):
            out_dir.rmdir()  # a folder this export made, and nothing in it
        raise


def reader(ckpt_path, dtype: str):
    """(the manifest of a verified checkpoint, ``assemble(name, shape)``: a parameter's
    full value from every rank's rows in ``dtype``, ``buffer(name)``: a buffer's)."""
    ckpt = resolve(ckpt_path)
    manifest = read_manifest(ckpt)
    problem = verify(ckpt, manifest, set(manifest["files"]))
    if problem:
        raise ValueError(problem)
    out_dtype = TORCH_DTYPES[dtype]
    handles: dict[str, object] = {}

    def opened(fname):
        if fname not in handles:
            handles[fname] = TensorFile(str(ckpt / fname))
        return handles[fname]

    def assemble(name, shape):  # from every file's box ([Note: checkpoints across tp
        full = torch.empty(shape or (1,), dtype=out_dtype)  # degrees] in tplayout.py)
        want = {0: (0, full.shape[0])}
        for f, fa, fb, have, common in pieces(manifest, name, want):
            place(full, want, opened(f).rows(name, fa, fb), have, common)
        return full.reshape(shape)

    def buffer(name):
        return opened(f"rank{0:05d}.safetensors").rows(f"{name}::buffer")

    return manifest, assemble, buffer


def _export(ckpt_path, out_dir: Path, dtype: str, max_shard_bytes: int) -> dict:
    manifest, assemble, buffer = reader(ckpt_path, dtype)
    out_dtype = TORCH_DTYPES[dtype]
    items = [(n, tuple(p["shape"])) for n, p in manifest["params"].items()]
    skip = set(manifest.get("nonpersistent", ()))  # as torch's state_dict() leaves them
    buffers = [(n, tuple(s)) for n, s in manifest["buffers"].items() if n not in skip]
    entries_ = [(n, s, out_dtype, lambda n=n, s=s: assemble(n, s)) for n, s in items]
    for n, s in buffers:
        src_dtype = buffer(n).dtype
        bdtype = out_dtype if src_dtype.is_floating_point else src_dtype
        entries_.append((n, s, bdtype, lambda n=n: buffer(n)))
    return write_entries(out_dir, entries_, max_shard_bytes)


def write_entries(out_dir: Path, entries_: list, max_shard_bytes: int) -> dict:
    """``(name, shape, dtype, produce)`` entries into safetensors files of at most
    ``max_shard_bytes`` (with an index when more than one), written whole. Returns
    {file: [names]}."""
    files, current, size = [], [], 0
    for e in entries_:
        nbytes = e[2].itemsize * int(torch.Size(e[1]).numel())
        if current and size + nbytes > max_shard_bytes:
            files.append(current)
            current, size = [], 0
        current.append(e)
        size += nbytes
    files.append(current)
    names = ([SINGLE] if len(files) == 1 else
             [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))])
    layout = {fname: [e[0] for e in group] for fname, group in zip(names, files)}
    writers = [(fname, lambda path, g=group: write_tensors(str(path), g, {"format": "pt"}))
               for fname, group in zip(names, files)]
    if len(files) > 1:
        total = sum(e[2].itemsize * int(torch.Size(e[1]).numel()) for e in entries_)
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, ns in layout.items() for n in ns}}
        writers.append((INDEX, lambda path: _write_json(path, index)))
    write_out_dir(out_dir, writers)
    return layout


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())


def _weight_map(path: Path) -> dict[str, Path]:
    if path.is_file():
        return dict.fromkeys(TensorFile(str(path)).keys(), path)
    if (path / INDEX).exists():
        from .._jsonfile import read_json_object

        wmap = read_json_object(path / INDEX, "index").get("weight_map")
        if not isinstance(wmap, dict) or not all(isinstance(f, str) for f in wmap.values()):
            raise ValueError(f"{path / INDEX}: no weight_map of tensor names to files")
        return {n: path / f for n, f in wmap.items()}
    if (path / SINGLE).exists():
        return _weight_map(path / SINGLE)
    raise ValueError(f"{path}: no {SINGLE}, no {INDEX} and not a safetensors file")


def load_pretrained(model, path: str | Path) -> None:
    """Initialise a ShardedModel from consolidated safetensors (a file, or a directory
    with ``model.safetensors`` or an index): each rank reads only the rows it keeps. A
    peft model takes its base model's weights (under the base model's names), its
    adapters as initialised."""
    sharded_model(model, "zs.load_pretrained()")
    path_given(path, "zs.load_pretrained()", "a safetensors file or a folder of them")
    problem, plan = None, []
    saved_name = base_model(model.module)[1]
    try:
        wmap = _weight_map(Path(path))
        handles: dict[Path, object] = {}
        for e in entries(model):
            key = saved_name(e.name)
            if key is None:
                continue  # a peft adapter: not in the base model's files
            if key not in wmap:
                raise ValueError(f"{path}: no tensor {key!r} for the model's parameter")
            if wmap[key] not in handles:
                handles[wmap[key]] = TensorFile(str(wmap[key]))
            f = handles[wmap[key]]
            shape = f.shape(key)
            if shape != e.shape:
                raise ValueError(f"{wmap[key]}: {key!r} has shape {shape}, the model "
                                 f"{e.shape}")
            plan.append((e, f, key))
    except ValueError as exc:
        problem = str(exc)
    except OSError as exc:  # a file the index names is missing or unreadable
        problem = f"{exc.filename or path}: {exc.strerror or exc}"
    _agree(model, problem)
    with torch.no_grad():
        for e, f, key in plan:
            a, b = e.held()
            if a < b:
                e.local(a, b).copy_(read_whole(f, key, e, a, b))
        for name, buf in model.module.named_buffers():
            if saved_name(name) in wmap:
                buf.copy_(TensorFile(str(wmap[saved_name(name)])).rows(saved_name(name)))
    model.refresh_compute()
    dist.barrier(model.mesh.control_group)
