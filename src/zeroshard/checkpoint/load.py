"""Loading a sharded checkpoint at any N and any stage (see the format note in
``zeroshard.checkpoint.sharded``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ..runtime.step.optim_state import attach
from .arguments import path_given, sharded_model
from .optstate import optimizers
from .sharded import entries, read_manifest, resolve, verify, verify_contents
from .tensorfile import TensorFile


def _pieces(manifest: dict, name: str, a: int, b: int):
    """(file, file rows [fa, fb), target rows [ta, tb)) covering full rows [a, b)."""
    out = []
    for fname, info in sorted(manifest["files"].items()):
        rows = info["rows"].get(name)
        if rows is None:
            continue
        lo, hi = max(a, rows[0]), min(b, rows[1])
        if lo < hi:
            out.append((fname, lo - rows[0], hi - rows[0], lo - a, hi - a))
    return out


def check_model(manifest: dict, model, path: Path) -> None:
    saved = manifest["params"]
    current = {e.name: list(e.shape) for e in entries(model)}
    for name, shape in current.items():
        if name not in saved:
            raise ValueError(f"{path}: checkpoint of a different model: it has no parameter "
                             f"{name!r}")
        if saved[name]["shape"] != shape:
            raise ValueError(f"{path}: checkpoint of a different model: {name!r} has shape "
                             f"{tuple(saved[name]['shape'])}, the model {tuple(shape)}")
    extra = sorted(set(saved) - set(current))
    if extra:
        raise ValueError(f"{path}: checkpoint of a different model: the model has no "
                         f"parameter {extra[0]!r}")


def _agree(model, problem: str | None) -> None:
    """Every rank raises if any rank found a problem: nothing is half-applied."""
    problems = [None] * model.mesh.dp_world
    dist.all_gather_object(problems, problem, group=model.mesh.dp_group)
    first = next((p for p in problems if p), None)
    if first:
        raise ValueError(first)


def load(model, optimizer, path: str | Path) -> dict:
    """Load a checkpoint written by :func:`save` at any N and stage into ``model`` and
    ``optimizer`` (one, or the list saved); return its ``extra``. ``path`` is a
    checkpoint or a directory with a ``latest`` pointer."""
    sharded_model(model, "zs.load()")
    path_given(path, "zs.load()")
    rank, world = model.mesh.shard_rank, model.mesh.shard_world  # (replicas read alike)
    problem, manifest, ckpt, plan = None, None, None, []
    try:
        ckpt = resolve(path)
        manifest = read_manifest(ckpt)
        check_model(manifest, model, ckpt)
        for e in entries(model):
            a, b = e.held()  # what this rank keeps: its shard, or whole weights
            pieces = _pieces(manifest, e.name, a, b)
            if sum(p[2] - p[1] for p in pieces) != b - a:
                raise ValueError(f"{ckpt}: rows {a}-{b} of {e.name!r} are in no file "
                                 "(a rank file is missing from the manifest)")
            plan.append((e, a, b, pieces))
        needed = {p[0] for _, _, _, pieces in plan for p in pieces}
        needed.add(f"rank{0:05d}.safetensors")  # buffers
        if manifest["world"] == world:
            needed.add(f"rank{rank:05d}.safetensors")  # this rank's RNG state
        problem = verify(ckpt, manifest, needed)
        if problem is None and optimizer is not None:
            problem = _check_groups(manifest, model, optimizer, ckpt)
        if problem is None:
            problem = _check_contents(ckpt, manifest, model, needed)
    except ValueError as exc:
        problem = str(exc)
    except Exception as exc:  # noqa: BLE001 - any failure on one rank stops every rank
        problem = f"{ckpt or path}: {type(exc).__name__}: {exc}"
    _agree(model, problem)
    _apply(model, optimizer, ckpt, manifest, plan, rank, world)
    for o in optimizers(optimizer):  # their state dicts speak DTensor from now on
        attach(model.stepper, o)
    return manifest["extra"]


def _check_contents(ckpt: Path, manifest: dict, model, needed: set[str]) -> str | None:
    """Parse every file this rank will read and find each tensor in it, before anything is
    applied: a file whose checksum matches but whose header does not (rewritten, or from
    another program) is named here, not half-way through a load."""
    for fname in sorted(needed):
        problem = verify_contents(ckpt, manifest, fname)
        if problem:
            return problem
    f0 = TensorFile(str(ckpt / f"rank{0:05d}.safetensors"))
    for name, buf in model.module.named_buffers():
        key = f"{name}::buffer"
        if key not in f0.header or f0.shape(key) != tuple(buf.shape):
            return f"{f0.path}: buffer {name!r} of shape {tuple(buf.shape)} is not there"
    return None


def _groups(optimizer) -> list[dict]:
    """Every param group of ``optimizer`` (one, or a list), in order."""
    return [g for o in optimizers(optimizer) for g in o.param_groups]


def _check_groups(manifest, model, optimizer, ckpt) -> str | None:
    saved = (manifest.get("optimizer") or {}).get("param_groups")
    classes = "+".join(type(o).__name__ for o in optimizers(optimizer))
    if saved is None:
        return f"{ckpt}: saved without an optimizer, cannot restore {classes}"
    names = {id(s): n for n, s in model.named_shards()}
    groups = _groups(optimizer)
    if len(saved) != len(groups):
        return (f"{ckpt}: {len(saved)} optimizer param groups saved, the optimizer "
                f"({classes}) has {len(groups)}")
    # frozen parameters have no state: which group lists them does not matter (DeepSpeed
    # leaves them out of its groups, a torch optimizer built from parameters() keeps them)
    frozen = {n for n, p in manifest["params"].items() if not p.get("trainable", True)}
    for k, (g, s) in enumerate(zip(groups, saved)):
        if ([n for p in g["params"] if (n := names[id(p)]) not in frozen]
                != [n for n in s["params"] if n not in frozen]):
            return f"{ckpt}: optimizer param group {k} holds other parameters than saved"
    return None


def _apply(model, optimizer, ckpt: Path, manifest: dict, plan, rank: int, world: int) -> None:
    handles = {}

    def opened(fname):
        if fname not in handles:
            handles[fname] = TensorFile(str(ckpt / fname))
        return handles[fname]

    with torch.no_grad():
        for e, a, b, pieces in plan:
            target = e.local(a, b)
            for fname, fa, fb, ta, tb in pieces:
                target[ta:tb].copy_(opened(fname).rows(e.name, fa, fb).reshape(tb - ta, e.row))
            if optimizer is None or not e.trainable or not pieces:
                continue  # (no pieces: this rank holds no rows of the parameter)
            f = opened(pieces[0][0])
            whole = set(json.loads(f.metadata.get("whole", "[]")))
            state = {}
            for full_key in [k for k in f.keys() if k.startswith(e.name + "::")]:
                key = full_key.split("::", 1)[1]
                if not f.shape(full_key) or full_key in whole:  # a step count; a whole one
                    state[key] = f.rows(full_key).to(e.shard.device)
                    continue
                rows = [opened(fname).rows(full_key, fa, fb) for fname, fa, fb, _, _ in pieces]
                state[key] = torch.cat(rows).reshape(
                    e.count, *f.shape(full_key)[1:]).to(e.shard.device)
            if state:
                holder = next((o for o in optimizers(optimizer) if any(
                    p is e.shard for g in o.param_groups for p in g["params"])), None)
                if holder is not None:
                    holder.state[e.shard] = state
        if optimizer is not None:
            for g, s in zip(_groups(optimizer), manifest["optimizer"]["param_groups"]):
                for k, v in s.items():
                    if k != "params":
                        g[k] = tuple(v) if isinstance(g.get(k), tuple) else v
        f0 = opened(f"rank{0:05d}.safetensors")
        for name, buf in model.module.named_buffers():
            buf.copy_(f0.rows(f"{name}::buffer"))
        own = opened(f"rank{rank:05d}.safetensors") if manifest["world"] == world else None
        if own is not None and "__rng_state__" in own.header:  # (an import has none)
            torch.set_rng_state(own.rows("__rng_state__"))
    model.refresh_compute()
