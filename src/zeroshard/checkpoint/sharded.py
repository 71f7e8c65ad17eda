"""Sharded checkpoints: ``save`` and ``load``.

[Note: format] A checkpoint is a directory of one ``rankNNNNN.safetensors`` per rank and
a ``manifest.json``. Tensors are keyed by original parameter name: ``name`` holds the
fp32 master rows (the weights themselves when there is no master; the compute weights
for a frozen parameter), ``name::key`` the optimizer state ``key`` for those rows (a
step count as a scalar; a state that is the same on every rank, as Adafactor's column
statistic of a matrix, whole, listed in the file's ``whole`` metadata), and
every file records which rows ``[a, b)`` of each full parameter it holds. Rank r of N
writes rows ``[r·c, r·c + c)``, c = ceil(rows / N) — its shard, or at stage 0 the rows it
would own — so saving never gathers and the format depends on neither the stage nor
the unit policy. Loading reads, for each parameter, the rows the loading rank needs,
from whichever files hold them: any N and any stage can load any checkpoint.

safetensors rather than torch.distributed.checkpoint: its lazy row slices make the
resharding read exact, a file can be written tensor by tensor (no copy of the shard in
memory) and checked by one sha256, and export/inspect need no process group.

[Note: atomicity] Ranks write into ``<name>.partial``; after a barrier rank 0 writes
the manifest (with every file's size and sha256) and renames the directory into place,
then replaces the ``latest`` pointer beside it. A rank killed at any moment leaves the
previous checkpoint and ``latest`` untouched. Loading checks every file it needs
(present, size, sha256, the model's names and shapes) on every rank, and agrees across
ranks, before it changes anything.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..runtime.dtensor import attach
from ..runtime.unit import held_rows, tp_dim
from ..spec.formulas import dim0_rows
from .arguments import check_save, said
from .foreign import refuse_foreign
from .integrity import verify, verify_contents  # noqa: F401 (re-exported: load, inspect, export)
from .optstate import optimizers, state_layout, state_of
from .sanity import FORMAT, LATEST, MANIFEST, check_manifest, ours_partial, pointed, pure_checkpoint
from .tensorfile import fsync_dir, write_tensors
from .tplayout import box, local_shape


def _rows(shape) -> int:
    return shape[0] if len(shape) else 1


def own_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [a, b) that rank r of ``world`` holds in a checkpoint: its dim-0 chunk, the
    same arithmetic as the engine's shards (``runtime/unit.py``)."""
    return dim0_rows(rows, rank, world)


class _Entry:
    """One parameter of a sharded model, and where its rows live on this rank: rows of its
    local slice beside tensor parallelism ([Note: checkpoints across tp degrees])."""

    def __init__(self, name, unit, index):
        self.name, self.unit, self.index = name, unit, index
        self.shard = unit.shards[index]
        self.shape = tuple(unit.params[index].shape)  # the full shape
        mesh = unit.comm.mesh
        self.tp_dim, self.tp_rank, self.tp_world = tp_dim(unit.params[index]), \
            mesh.tp_rank, mesh.tp_world
        if self.tp_world == 1:
            self.tp_dim = None
        self.local_shape = local_shape(self.shape, self.tp_dim, self.tp_world)
        self.rows = _rows(self.local_shape)
        self.trainable = index in unit.trainable
        # the optimizer-facing shard (the master), or a frozen parameter kept whole
        self.source, self.first = held_rows(unit, index)
        self.count = (self.source.shape[0] if self.source.dim() else 1)
        self.row = self.source.numel() // self.count if self.count else 0  # elements per row
        if not self.count:  # no rows here (fewer rows than ranks): the row size from the shape
            self.row = max(1, torch.Size(self.local_shape).numel()) // self.rows

    def local(self, a: int, b: int) -> torch.Tensor:
        """This rank's view of full rows [a, b) (which it must hold), as [b - a, row]."""
        return self.source.detach().reshape(self.count, self.row)[a - self.first:b - self.first]

    def held(self) -> tuple[int, int]:
        """Rows of the local slice whose values this rank holds."""
        return self.first, self.first + self.count

    def box(self, a: int, b: int) -> dict[int, tuple]:
        """The full tensor's ranges of local rows [a, b) (``tplayout.box``)."""
        return box(self.shape or (1,), self.tp_dim, self.tp_rank, self.tp_world, a, b)


def entries(model) -> list[_Entry]:
    by_name = {u.names[i]: _Entry(u.names[i], u, i) for u in model.units
               for i in range(len(u.names))}
    return [by_name[n] for n, _ in model.named_shards()]


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or the one a directory's ``latest`` pointer names (the
    pointer file itself may be given: ``runs/ckpt/latest``)."""
    path = Path(path)
    if path.name == LATEST and path.is_file():
        path = path.parent
    if not path.exists():
        raise ValueError(f"{path}: no such checkpoint folder")
    if (path / MANIFEST).exists():
        return path
    if (path / LATEST).exists():
        named = path / pointed(path / LATEST)
        old = named.with_name(named.name + ".old")
        if not (named / MANIFEST).exists() and (old / MANIFEST).exists():
            # a save that overwrote ``named`` was stopped between moving the old copy
            # aside and moving the new one in (``_publish``): the old copy is complete
            return old
        if not (named / MANIFEST).exists():
            refuse_foreign(path)
        return named
    refuse_foreign(path)
    raise ValueError(f"{path} is not a zeroshard checkpoint: no {MANIFEST} and no {LATEST} "
                     "pointer")


def read_manifest(ckpt: Path) -> dict:
    from .._jsonfile import read_json_object

    manifest = read_json_object(ckpt / MANIFEST, "checkpoint manifest")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{ckpt / MANIFEST}: not a {FORMAT} manifest")
    missing = [k for k in ("world", "params", "buffers", "files", "extra") if k not in manifest]
    if missing:
        raise ValueError(f"{ckpt / MANIFEST}: the manifest lacks {missing} (damaged, or "
                         "written by another program)")
    check_manifest(manifest, ckpt / MANIFEST)
    return manifest


class SaveFailed(OSError):
    """A checkpoint could not be written; the one before it (if any) is intact."""


def save(model, optimizer, path: str | Path, extra: dict | None = None) -> Path:
    """Write a checkpoint of ``model`` (a ShardedModel) and ``optimizer`` (one, or a list
    over disjoint parameters: Muon and AdamW) to directory ``path``, every rank its own
    rows in parallel; move ``latest`` beside it last.
    ``extra`` (JSON) is stored in the manifest and returned by :func:`load`.

    A failure on any rank (a full disk, a folder made read-only) is one
    :class:`SaveFailed` on every rank, with the unfinished ``.partial`` folder removed
    and ``latest`` still naming the last complete checkpoint.

    Under hybrid sharding the ranks of the first shard group write (rows by their place
    in the group, K files); the replica groups hold the same rows and write nothing.
    Beside tensor parallelism every tp rank's first shard group writes (T·K files,
    [Note: checkpoints across tp degrees]), a parameter every tp rank holds whole by tp
    rank 0 only."""
    check_save(model, optimizer, path, extra)  # extra agreed by every rank: JSON, or refused
    mesh = model.mesh
    rank, world = mesh.shard_rank, mesh.shard_world
    writer = mesh.replica_rank == 0
    for o in optimizers(optimizer):  # their state dicts speak DTensor from now on
        attach(model.stepper, o)
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    model.synchronize()
    problem = None
    first = _first(model)
    if first:
        try:  # a partial of a stopped save (check_save found nothing else in the way)
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        except OSError as exc:
            problem = f"{partial}: {exc.strerror or exc}"
    _agree_saved(model, problem, partial)
    problem, files = None, None
    try:
        files = _write_rows(model, optimizer, partial, rank, world) if writer else None
    except Exception as exc:  # noqa: BLE001 - one rank's error reaches every rank at once
        problem = f"rank {dist.get_rank()}: {said(exc, partial)}"
    _agree_saved(model, problem, partial)
    every = [None] * mesh.control_world
    dist.all_gather_object(every, files, group=mesh.control_group)
    problem = None
    if first:
        try:
            _publish(model, optimizer, path, partial, [f for f in every if f], extra or {})
        except Exception as exc:  # noqa: BLE001 - one rank's error reaches every rank at once
            problem = said(exc, path)
    _agree_saved(model, problem, partial)
    return path


def _first(model) -> bool:
    """Whether this rank is the first of the ranks that save and load together: the
    data-parallel ones, or every rank of the mesh beside tensor parallelism (the control
    group's, [Note: tensor-parallel mesh] in ``runtime/mesh.py``)."""
    return dist.get_rank(model.mesh.control_group) == 0


def _agree_saved(model, problem: str | None, partial: Path) -> None:
    """Every rank learns whether any rank failed; if so the ``.partial`` folder goes
    and every rank raises the same :class:`SaveFailed`."""
    problems = [None] * model.mesh.control_world
    dist.all_gather_object(problems, problem, group=model.mesh.control_group)
    first = next((p for p in problems if p), None)
    if first:
        if _first(model):
            shutil.rmtree(partial, ignore_errors=True)
        # the others raise (and may save again) once it is gone, not while rank 0 removes
        # it: half removed, it is no longer what a save leaves, and a retry refuses it
        dist.barrier(group=model.mesh.control_group)
        raise SaveFailed(f"checkpoint not saved: {first}; the last complete checkpoint "
                         "beside it is untouched")


def _write_rows(model, optimizer, partial: Path, rank: int, world: int) -> dict:
    """This rank's file of the checkpoint: the rows it owns of every parameter and of
    its optimizer state, its RNG state, and (rank 0) the buffers."""
    plan, rows, whole = [], {}, []
    opts = optimizers(optimizer)
    tp_rank = model.mesh.tp_rank
    for e in entries(model):
        a, b = own_rows(e.rows, rank, world)
        if a == b or (tp_rank and e.tp_dim is None):  # whole on every tp rank: tp rank 0's
            continue
        rows[e.name] = [a, b]
        shape = (b - a, *e.local_shape[1:])
        plan.append((e.name, shape, e.source.dtype,
                     lambda e=e, a=a, b=b, shape=shape: e.local(a, b).reshape(shape)))
        owner, state = state_of(opts, e.shard)
        for key, value in state.items():
            layout = state_layout(owner, key, value, e)
            if layout == "rows":
                plan.append((f"{e.name}::{key}", (b - a, *value.shape[1:]), value.dtype,
                             lambda v=value, e=e, a=a, b=b: v.reshape(v.shape[0], -1)
                             [a - e.first:b - e.first].reshape(b - a, *v.shape[1:])))
            elif layout == "whole":  # alike on every rank: each file keeps a copy
                whole.append(f"{e.name}::{key}")
                plan.append((whole[-1], tuple(value.shape), value.dtype, lambda v=value: v))
            elif torch.is_tensor(value) or isinstance(value, (int, float)):
                t = torch.as_tensor(value)
                plan.append((f"{e.name}::{key}", (), t.dtype, lambda t=t: t))
    rng = torch.get_rng_state()
    plan.append(("__rng_state__", tuple(rng.shape), rng.dtype, lambda: rng))
    if rank == 0 and tp_rank == 0:
        for name, buf in model.module.named_buffers():
            plan.append((f"{name}::buffer", tuple(buf.shape), buf.dtype, lambda b=buf: b))
    fname = f"rank{tp_rank * world + rank:05d}.safetensors"
    sha, size = write_tensors(str(partial / fname), plan,
                              {"rows": json.dumps(rows), "whole": json.dumps(whole)})
    return {"file": fname, "sha256": sha, "bytes": size, "rows": rows, "tp_rank": tp_rank}


def _publish(model, optimizer, path: Path, partial: Path, files, extra) -> None:
    names = {id(s): n for n, s in model.named_shards()}
    groups = []
    opts = optimizers(optimizer)
    for g in (g for o in opts for g in o.param_groups):
        hyper = {k: v for k, v in g.items() if k != "params"
                 and isinstance(v, (int, float, str, bool, list, tuple, type(None)))}
        groups.append({**hyper, "params": [names[id(p)] for p in g["params"]]})
    manifest = {
        "format": FORMAT, "version": 1, "world": model.mesh.shard_world,
        "tp": model.mesh.tp_world,
        "stage": model.zero_config.stage, "recipe": model.zero_config.recipe.name,
        "params": {e.name: {"shape": list(e.shape), "dtype": str(e.source.dtype)[6:],
                            "trainable": e.trainable,
                            **({"tp": {"dim": e.tp_dim}} if e.tp_dim is not None else {})}
                   for e in entries(model)},
        "buffers": {n: list(b.shape) for n, b in model.module.named_buffers()},
        # buffers a module registered with persistent=False (rotary tables): resumed with
        # the rest, but no part of a state dict, so not of an export
        "nonpersistent": sorted(
            f"{prefix}.{n}" if prefix else n for prefix, m in model.module.named_modules()
            for n in getattr(m, "_non_persistent_buffers_set", ())),
        # several optimizers: their classes in order, their groups one after another
        "optimizer": None if not opts else {
            "class": "+".join(type(o).__name__ for o in opts), "param_groups": groups},
        "files": {f["file"]: {k: f[k] for k in ("sha256", "bytes", "rows", "tp_rank")}
                  for f in files},
        "extra": extra,
    }
    move_in(partial, path, manifest)
    pointer = path.parent / (LATEST + ".partial")
    pointer.write_text(path.name + "\n")
    os.replace(pointer, path.parent / LATEST)
    fsync_dir(str(path.parent))
    # what saves stopped by a kill left beside it: incomplete copies go; a complete copy
    # that a stopped overwrite moved aside gets its name back; nothing else is touched
    # ([Note: a writer owns only what it wrote] in sanity.py)
    for leftover in path.parent.glob("*.partial"):
        if ours_partial(leftover):
            shutil.rmtree(leftover, ignore_errors=True)
    for old in path.parent.glob("*.old"):
        named = old.with_name(old.name[:-len(".old")])
        if not named.exists() and pure_checkpoint(old):
            os.replace(old, named)


def move_in(partial: Path, path: Path, manifest: dict) -> None:
    """Finish a checkpoint written into ``partial``: its manifest last (a folder without
    one is never taken for a checkpoint), made durable, then the folder renamed to
    ``path`` (an earlier checkpoint at ``path`` is moved aside first and dropped after;
    the callers checked that it is one, [Note: a writer owns only what it wrote])."""
    with open(partial / MANIFEST, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(str(partial))
    if path.is_dir() and any(path.iterdir()):  # an earlier checkpoint (check_target):
        # moved aside first, dropped after (a rename replaces an empty folder itself)
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, path)
    fsync_dir(str(path.parent))
