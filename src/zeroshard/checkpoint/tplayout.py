"""Where a parameter's rows sit in the full tensor beside tensor parallelism.

[Note: checkpoints across tp degrees] A checkpoint file holds rows of each parameter as
its writer held them: rows ``[a, b)`` of the writer's *local slice* — the whole parameter
where tensor parallelism does not split it, else tp rank t's slice of dim d, DTensor's
even split (``Shard(d)``: indices ``[t·n/T, (t+1)·n/T)`` of the ``n`` on dim d). The
manifest records the tp degree T, each split parameter's dim d (``params[name]["tp"]``)
and each file's tp rank. So the rows of a file are a *box* of the full tensor: a range on
dim 0 and, where d > 0, one on dim d (where d = 0 the rows are offset by t·n/T). A
loading rank wants the box of its own rows (its local slice at its tp degree, its shard
at its data-parallel rank) and copies in the intersection with every file's box: any tp
degree and any data-parallel size load any checkpoint, and a checkpoint without ``tp``
(written at tp = 1, or by an older zeroshard) is boxes of whole rows.
"""

from __future__ import annotations

import torch


def _split(shape, d, t: int, world: int) -> tuple[int, int]:
    n = shape[d] // world
    return t * n, (t + 1) * n


def box(shape, d: int | None, t: int, world: int, a: int, b: int) -> dict[int, tuple]:
    """The full tensor's ranges (dim -> [lo, hi)) of rows ``[a, b)`` of tp rank ``t``'s
    slice (of ``world``) of a parameter of ``shape`` split on dim ``d`` (None: whole)."""
    if d is None:
        return {0: (a, b)}
    lo, hi = _split(shape, d, t, world)
    if d == 0:
        return {0: (lo + a, lo + b)}
    return {0: (a, b), d: (lo, hi)}


def local_shape(shape, d: int | None, world: int) -> tuple[int, ...]:
    """The shape of a tp rank's slice."""
    shape = list(shape)
    if d is not None:
        shape[d] //= world
    return tuple(shape)


def saved_split(manifest: dict, name: str) -> tuple[int | None, int]:
    """(dim, degree) tensor parallelism split ``name`` on in ``manifest`` (None, 1 where
    it did not)."""
    tp = (manifest.get("params", {}).get(name) or {}).get("tp")
    return (None, 1) if tp is None else (tp["dim"], manifest.get("tp", 1))


def saved_local_shape(manifest: dict, name: str) -> tuple[int, ...]:
    d, world = saved_split(manifest, name)
    return local_shape(manifest["params"][name]["shape"], d, world)


def pieces(manifest: dict, name: str, want: dict[int, tuple]) -> list[tuple]:
    """(file, the file's rows [fa, fb) to read (counted in the file), the box of all its
    rows, the part of ``want`` they fill) for every file holding part of box ``want`` of
    ``name``."""
    shape = (manifest.get("params", {}).get(name) or {}).get("shape") or [1]
    d, world = saved_split(manifest, name)
    out = []
    for fname, info in sorted(manifest["files"].items()):
        rows = info["rows"].get(name)
        if rows is None:
            continue
        have = box(shape, d, info.get("tp_rank", 0), world, rows[0], rows[1])
        common = {}
        for dim in set(want) | set(have):
            full = (0, shape[dim])
            lo = max(want.get(dim, full)[0], have.get(dim, full)[0])
            hi = min(want.get(dim, full)[1], have.get(dim, full)[1])
            if lo >= hi:
                break
            common[dim] = (lo, hi)
        else:
            fa = common[0][0] - have[0][0]  # the file's own rows count from 0
            out.append((fname, fa, fa + common[0][1] - common[0][0], have, common))
    return out


def volume(part: dict[int, tuple], shape) -> int:
    n = 1
    for dim, size in enumerate(shape or [1]):
        lo, hi = part.get(dim, (0, size))
        n *= hi - lo
    return n


def place(target: torch.Tensor, want: dict[int, tuple], rows: torch.Tensor,
          have: dict[int, tuple], common: dict[int, tuple]) -> None:
    """Copy ``rows`` (the file's rows of box ``common`` on dim 0, of ``have`` on the
    others) into ``target`` (shaped as box ``want``)."""
    for dim, (lo, hi) in common.items():
        if dim:  # (a dim neither box restricts starts at 0 in both)
            rows = rows.narrow(dim, lo - have.get(dim, (0,))[0], hi - lo)
            target = target.narrow(dim, lo - want.get(dim, (0,))[0], hi - lo)
    target.narrow(0, common[0][0] - want[0][0], common[0][1] - common[0][0]).copy_(rows)


def read_whole(f, name: str, e, a: int, b: int) -> torch.Tensor:
    """Rows ``[a, b)`` of entry ``e``'s local slice, read from the full tensor ``name``
    of file ``f`` (consolidated safetensors, a Hugging Face folder)."""
    want = box(e.shape or (1,), e.tp_dim, e.tp_rank, e.tp_world, a, b)
    rows = f.rows(name, *want[0])
    if e.tp_dim:
        rows = rows.narrow(e.tp_dim, want[e.tp_dim][0], want[e.tp_dim][1] - want[e.tp_dim][0])
    return rows.reshape(b - a, e.row)
