"""Loading a sharded checkpoint at any N and any stage (see the format note in
``zeroshard.checkpoint.sharded``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ..runtime.dtensor import attach
from .arguments import path_given, sharded_model
from .optstate import optimizers
from .sharded import entries, read_manifest, resolve, verify, verify_contents
from .tensorfile import TensorFile
from .tplayout import pieces, place, saved_local_shape, volume


def _pieces(manifest: dict, name: str, a: int, b: int):
    """(file, file rows [fa, fb), target rows [ta, tb)) covering full rows [a, b) of a
    parameter tensor parallelism does not split (``export``'s reading)."""
    return [(fname, fa, fb, common[0][0] - a, common[0][1] - a)
            for fname, fa, fb, _, common in pieces(manifest, name, {0: (a, b)})]


def _same_names(name: str) -> str:
    return name


def check_model(manifest: dict, model, path: Path, saved_name=_same_names) -> None:
    """The checkpoint holds exactly the model's parameters (under ``saved_name`` of each
    of the model's names, which is None for a parameter the checkpoint does not hold)."""
    saved = manifest["params"]
    current = {saved_name(e.name): list(e.shape) for e in entries(model)
               if saved_name(e.name) is not None}
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
    problems = [None] * model.mesh.control_world  # every rank of the mesh beside tp
    dist.all_gather_object(problems, problem, group=model.mesh.control_group)
    first = next((p for p in problems if p), None)
    if first:
        raise ValueError(first)


def load(model, optimizer, path: str | Path) -> dict:
    """Load a checkpoint written by :func:`save` at any N and stage into ``model`` and
    ``optimizer`` (one, or the list saved); return its ``extra``. ``path`` is a
    checkpoint or a directory with a ``latest`` pointer. Any tensor-parallel degree loads
    any other's ([Note: checkpoints across tp degrees] in ``tplayout.py``)."""
    sharded_model(model, "zs.load()")
    path_given(path, "zs.load()")
    return _load(model, optimizer, path, _same_names)


PEFT_PREFIX, BASE_LAYER = "base_model.model.", ".base_layer."


def peft_base_name(name: str) -> str | None:
    """The base model's name of a peft model's tensor (None for an adapter's)."""
    if ".lora_" in name:
        return None
    return name.removeprefix(PEFT_PREFIX).replace(BASE_LAYER, ".")


def base_model(module):
    """(the model the weight files are of, its name there of each of ``module``'s tensors:
    a peft model's base model, and its names without peft's prefixes — None for an
    adapter's, which the files do not hold; any other model and its own names)."""
    if hasattr(module, "peft_config") and hasattr(module, "get_base_model"):
        return module.get_base_model(), peft_base_name
    return module, lambda n: n


def load_weights(model, path: str | Path) -> dict:
    """Only the weights of checkpoint ``path`` (``zeroshard train --init-from CKPT``): no
    optimizer state, RNG state or schedule. A peft model (``--lora``) takes its base
    model's weights under the base model's names, its adapters as initialised. Returns
    the checkpoint's ``extra``."""
    return _load(model, None, path, base_model(model.module)[1])


def _load(model, optimizer, path, saved_name) -> dict:
    """``load``: every rank plans and checks what it reads, the ranks agree, then every
    rank applies it. ``saved_name``: the checkpoint's name of each of the model's
    parameters and buffers (None: not in it, left as it is)."""
    mesh = model.mesh
    rank, world = mesh.shard_rank, mesh.shard_world  # (replicas read alike)
    own_file = f"rank{mesh.tp_rank * world + rank:05d}.safetensors"
    problem, manifest, ckpt, plan = None, None, None, []
    try:
        ckpt = resolve(path)
        manifest = read_manifest(ckpt)
        check_model(manifest, model, ckpt, saved_name)
        for e in entries(model):
            if saved_name(e.name) is None:
                continue
            a, b = e.held()  # what this rank keeps: its shard, or whole weights
            want = e.box(a, b)
            found = pieces(manifest, saved_name(e.name), want)
            if sum(volume(p[4], e.shape) for p in found) != volume(want, e.shape):
                raise ValueError(f"{ckpt}: rows {a}-{b} of {e.name!r} are in no file "
                                 "(a rank file is missing from the manifest)")
            plan.append((e, a, b, want, found))
        needed = {p[0] for *_, found in plan for p in found}
        needed.add(f"rank{0:05d}.safetensors")  # buffers
        same = (manifest["world"] == world and manifest.get("tp", 1) == mesh.tp_world
                and saved_name is _same_names)
        if same:
            needed.add(own_file)  # this rank's RNG state
        problem = verify(ckpt, manifest, needed)
        if problem is None and optimizer is not None:
            problem = _check_groups(manifest, model, optimizer, ckpt)
        if problem is None:
            problem = _check_contents(ckpt, manifest, model, needed, saved_name)
    except ValueError as exc:
        problem = str(exc)
    except Exception as exc:  # noqa: BLE001 - any failure on one rank stops every rank
        problem = f"{ckpt or path}: {type(exc).__name__}: {exc}"
    _agree(model, problem)
    _apply(model, optimizer, ckpt, manifest, plan, own_file if same else None, saved_name)
    for o in optimizers(optimizer):  # their state dicts speak DTensor from now on
        attach(model.stepper, o)
    return manifest["extra"]


def _check_contents(ckpt: Path, manifest: dict, model, needed: set[str],
                    saved_name=_same_names) -> str | None:
    """Parse every file this rank will read and find each tensor in it, before anything is
    applied: a file whose checksum matches but whose header does not (rewritten, or from
    another program) is named here, not half-way through a load."""
    for fname in sorted(needed):
        problem = verify_contents(ckpt, manifest, fname)
        if problem:
            return problem
    f0 = TensorFile(str(ckpt / f"rank{0:05d}.safetensors"))
    for name, buf in model.module.named_buffers():
        key = f"{saved_name(name)}::buffer"
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


def _apply(model, optimizer, ckpt: Path, manifest: dict, plan, own: str | None,
           saved_name=_same_names) -> None:
    handles = {}

    def opened(fname):
        if fname not in handles:
            handles[fname] = TensorFile(str(ckpt / fname))
        return handles[fname]

    def read(key: str, target: torch.Tensor, want, found) -> None:
        for fname, fa, fb, have, common in found:
            place(target, want, opened(fname).rows(key, fa, fb), have, common)

    with torch.no_grad():
        for e, a, b, want, found in plan:
            shape = (b - a, *e.local_shape[1:])
            read(saved_name(e.name), e.local(a, b).view(shape), want, found)
            if optimizer is None or not e.trainable or not found:
                continue  # (no pieces: this rank holds no rows of the parameter)
            f = opened(found[0][0])
            whole = set(json.loads(f.metadata.get("whole", "[]")))
            state = {}
            for full_key in [k for k in f.keys() if k.startswith(e.name + "::")]:
                key = full_key.split("::", 1)[1]
                if not f.shape(full_key):  # a step count
                    state[key] = f.rows(full_key).to(e.shard.device)
                    continue
                per_element = (full_key not in whole and tuple(f.shape(full_key)[1:])
                               == tuple(saved_local_shape(manifest, e.name)[1:]))
                if per_element:  # placed as the parameter's own rows, at any tp degree
                    rows = torch.empty(shape, dtype=f.dtype(full_key))
                    read(full_key, rows, want, found)
                    state[key] = rows.reshape(e.shard.shape).to(e.shard.device)
                    continue
                if manifest.get("tp", 1) != model.mesh.tp_world:
                    # a sum over a row's or a column's elements (Adafactor's statistics),
                    # which another tp degree cuts differently: no rows of it are right
                    raise ValueError(f"{ckpt}: optimizer state {key!r} of {e.name!r} is not "
                                     "per element: it loads at the tp degree it was saved "
                                     f"at ({manifest.get('tp', 1)}), not at "
                                     f"{model.mesh.tp_world}")
                if full_key in whole:  # alike on every rank of a tp rank's files
                    state[key] = f.rows(full_key).to(e.shard.device)
                    continue
                rows = [opened(fname).rows(full_key, fa, fb) for fname, fa, fb, _, _ in found]
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
            buf.copy_(f0.rows(f"{saved_name(name)}::buffer"))
        own = opened(own) if own is not None else None
        if own is not None and "__rng_state__" in own.header:  # (an import has none)
            torch.set_rng_state(own.rows("__rng_state__"))
    model.refresh_compute()
