"""Each parameter of a DeepSpeed checkpoint as pieces of saved tensors (see the layout note
in ``layout.py``), and reading a range of its elements from them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ...spec.formulas import ceil_div
from .torchfile import Lazy


@dataclass
class Param:
    """One parameter: its pieces per state key ("" for the weights) in element order, and
    its scalar optimizer state (Adam's step)."""

    name: str
    shape: tuple[int, ...]
    trainable: bool
    pieces: dict[str, list[tuple[Lazy, int, int]]] = field(default_factory=dict)
    scalars: dict[str, object] = field(default_factory=dict)


def as_int(value) -> int:
    return int(value)  # a plain int, or DeepSpeed's ZeroStageEnum (a torchfile.Opaque)


#: optimizer param-group values kept in the manifest (as ``zs.save`` keeps them)
_PLAIN = (int, float, str, bool, list, tuple, type(None))


def _hyper(group) -> dict:
    return {k: v for k, v in group.items() if k != "params" and isinstance(v, _PLAIN)}


def _split(state: dict, length: int) -> tuple[list[str], dict]:
    """The per-element keys of a flat group's optimizer state (tensors along the flat
    partition, at least ``length`` long: padded, or cut like the weights) and the rest
    (scalars such as Adam's step)."""
    keys = [k for k, v in state.items()
            if isinstance(v, Lazy) and len(v.shape) == 1 and v.numel() >= length]
    rest = {k: v for k, v in state.items() if k not in keys and (
        (isinstance(v, Lazy) and not v.shape) or type(v) in (int, float))}
    return keys, rest


def _shape(shape) -> tuple[int, ...]:
    return tuple(int(d) for d in shape)


def stage12_params(shapes, states, world: int, folder, cut: bool = True) -> tuple[list, list]:
    """Stages 1-2: per param group one flat buffer cut into N equal partitions
    (``runtime/zero/stage_1_and_2.py``: ``__init__``, ``state_dict``). ``cut``: the saved
    slices lost the buffer's trailing padding (``_get_groups_without_padding``), as
    DeepSpeed's ZeRO optimizer saves them; its BF16_Optimizer (``runtime/bf16_optimizer.py``,
    same flat layout without per-parameter alignment) saves them whole."""
    align = states[0].get("param_alignment_paddings")
    params, groups = [], []
    for g, group_shapes in enumerate(shapes):
        parts = [s["single_partition_of_fp32_groups"][g] for s in states]
        padding = [as_int(s["group_paddings"][g]) for s in states]
        lens = [t.numel() - (0 if cut else padding[r]) for r, t in enumerate(parts)]  # real
        sizes = {lens[r] + padding[r] for r in range(world)}  # P, the padding added back
        if len(sizes) != 1:
            raise ValueError(f"{folder}: param group {g}'s rank partitions differ in size "
                             f"({sorted(sizes)}); not a ZeRO-1/2 layout this importer knows")
        size = sizes.pop()
        base = [s["base_optimizer_state"] for s in states]
        # non-elastic: the inner optimizer's state_dict(); elastic: a list of group states
        opt = [b["state"].get(g, {}) if isinstance(b, dict) else b[g] for b in base]
        keys, scalars = _split(opt[0], lens[0])
        pads = align[g] if align else [0] * len(group_shapes)
        if len(pads) != len(group_shapes):
            raise ValueError(f"{folder}: param group {g} has {len(group_shapes)} parameters "
                             f"and {len(pads)} alignment paddings")
        offset = 0
        for j, (name, shape) in enumerate(group_shapes.items()):
            shape = _shape(shape)
            n = math.prod(shape)
            ranges = []
            for r in range(world):
                lo, hi = max(offset, r * size), min(offset + n, r * size + lens[r])
                if lo < hi:
                    ranges.append((r, lo - r * size, hi - r * size))
            if sum(hi - lo for _, lo, hi in ranges) != n:
                raise ValueError(f"{folder}: {name!r} runs past the saved partitions of "
                                 f"param group {g} (the shapes do not match the optimizer files)")
            p = Param(name, shape, True, {"": [(parts[r], a, b) for r, a, b in ranges]},
                      dict(scalars))
            for k in keys:
                p.pieces[k] = [(opt[r][k], a, b) for r, a, b in ranges]
            params.append(p)
            offset += n + int(pads[j])
        # zero_to_fp32's own check: both ends agree once aligned to 2·N
        align_to = 2 * world
        if ceil_div(offset, align_to) != ceil_div(sum(lens), align_to):
            raise ValueError(f"{folder}: param group {g}'s shapes cover {offset} elements, its "
                             f"partitions hold {sum(lens)}")
        hyper = _hyper(base[0]["param_groups"][g]) if isinstance(base[0], dict) else {}
        groups.append({**hyper, "params": list(group_shapes)})
    return params, groups


def stage3_params(shapes, states, world: int, folder) -> tuple[list, list]:
    """Stage 3: each parameter split on its own into N pieces of ceil(numel / N), the
    pieces of a sub-group concatenated per rank (``runtime/zero/stage3.py``
    ``_rigid_state_dict``; ``partition_parameters.py`` ``_partition_param``)."""
    params, names = [], []
    for s, sub_shapes in enumerate(shapes):
        flats = [st["fp32_flat_groups"][s] for st in states]
        opt = [st["optimizer_state_dict"]["state"].get(s, {}) for st in states]
        keys, scalars = _split(opt[0], flats[0].numel())
        offset = 0
        for name, shape in sub_shapes.items():
            shape = _shape(shape)
            n = math.prod(shape)
            c = ceil_div(n, world)
            ranges = [(r, offset, offset + min(c, n - r * c)) for r in range(world) if r * c < n]
            p = Param(name, shape, True, {"": [(flats[r], a, b) for r, a, b in ranges]},
                      dict(scalars))
            for k in keys:
                p.pieces[k] = [(opt[r][k], a, b) for r, a, b in ranges]
            params.append(p)
            offset += c
        if any(f.numel() != offset for f in flats):
            raise ValueError(f"{folder}: sub-group {s}'s shapes cover {offset} elements per "
                             f"rank, its partitions hold {sorted({f.numel() for f in flats})}")
        names.append(list(sub_shapes))
    inner = states[0]["optimizer_state_dict"]["param_groups"]
    groups = [{**_hyper(g), "params": [n for s in g["params"] for n in names[s]]} for g in inner]
    return params, groups


def frozen_params(m0: dict, fragments: list[dict], trainable: set, partitioned: bool,
                  world: int) -> list:
    """Parameters outside the optimizer: ``frozen_param_fragments`` (stages 2-3; at stage 3
    each rank's piece, split like a trainable one, ``fragments[r]`` rank r's), or at stage
    1, which saves no fragments (``runtime/engine.py`` ``_save_checkpoint``), the weights in
    rank 0's model-states file ``m0``'s ``module``."""
    shapes = m0.get("frozen_param_shapes") or {}
    out = []
    for name, shape in shapes.items():
        shape = _shape(shape)
        n = math.prod(shape)
        if partitioned:
            c = ceil_div(n, world)
            pieces = [(f[name], 0, min(c, n - r * c)) for r, f in enumerate(fragments)
                      if r * c < n]
            pieces = pieces or [(fragments[0][name], 0, 0)]  # (no elements)
        else:
            pieces = [(fragments[0][name], 0, n)]
        out.append(Param(name, shape, False, {"": pieces}))
    if not partitioned:
        skip = (trainable | set(shapes) | set(m0.get("buffer_names") or [])
                | set(m0.get("shared_params") or {}))
        out += [Param(n, _shape(t.shape), False, {"": [(t, 0, t.numel())]})
                for n, t in (m0.get("module") or {}).items()
                if n not in skip and isinstance(t, Lazy)]
    return out


def gather(pieces: list[tuple[Lazy, int, int]], a: int, b: int) -> torch.Tensor:
    """Elements [a, b) of a parameter (or of one of its optimizer states) whose elements
    are ``pieces`` in order, read from the files into one tensor of b - a elements."""
    out = torch.empty(b - a, dtype=pieces[0][0].dtype)
    pos = 0
    for tensor, lo, hi in pieces:
        s, e = max(a, pos), min(b, pos + hi - lo)
        if s < e:
            tensor.read(lo + s - pos, lo + e - pos, out[s - a:e - a])
        pos += hi - lo
    return out


def scalar(value) -> torch.Tensor:
    """A scalar optimizer state as the 0-d tensor torch's optimizers keep."""
    if isinstance(value, Lazy):
        return value.load()
    return torch.tensor(float(value), dtype=torch.float32)
