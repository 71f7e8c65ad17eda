"""What a DeepSpeed ZeRO checkpoint holds, and where each parameter's elements lie in it.

[Note: DeepSpeed's layouts] A DeepSpeed save is ``DIR/latest`` (a tag) and ``DIR/<tag>/``
with one ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank
and model-states files (``mp_rank_00_model_states.pt`` at stages 1-2, one
``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank at stage 3), all ``torch.save``
pickles (``runtime/engine.py``: ``_get_ckpt_name``, ``_get_rank_zero_ckpt_name``). The
model-states file carries ``param_shapes`` (one ordered name -> shape map per group, in
the order the flat buffers hold them: ``_get_zero_param_shapes``), ``buffer_names``,
``shared_params`` (tied names; at stage 3 in rank 0's file only), ``frozen_param_shapes``
and ``frozen_param_fragments`` (stages 2-3), ``global_steps`` and ``module`` (weights in
the compute dtype, and the buffers: ``_save_checkpoint``, ``_common_checkpoint_state``).

- Stages 1-2 (``runtime/zero/stage_1_and_2.py``): per param group, the trainable
  parameters in ``param_shapes`` order are flattened into one buffer, parameter j followed
  by ``param_alignment_paddings[g][j]`` zeros, the whole padded to a multiple of 2·N;
  rank r owns elements [r·P, r·P + P). ``state_dict`` saves rank r's fp32 slice in
  ``single_partition_of_fp32_groups[g]`` with the buffer's trailing padding cut off
  (``group_paddings[g]`` elements), so P = saved length + group padding. Adam's moments
  for that slice are ``base_optimizer_state["state"][g]`` (padded to P; with
  ``elastic_checkpoint`` a list of states cut like the weights), its step a 0-d tensor
  there. DeepSpeed's BF16_Optimizer (bf16 at stage 1 with fp32 gradient accumulation,
  ``runtime/bf16_optimizer.py``) lays the groups out alike, without per-parameter
  alignment, and saves its slices uncut and no ``zero_stage``.
- Stage 3 (``runtime/zero/stage3.py``, ``partition_parameters.py``): every parameter is
  flattened and split on its own: c = ceil(numel / N) elements per rank, the last rank's
  piece padded with zeros. Per sub-group (``sub_group_size``) rank r keeps the
  concatenation of its pieces in ``fp32_flat_groups[s]``; the moments are the inner
  optimizer's ``optimizer_state_dict["state"][s]``, in the same layout;
  ``param_shapes[s]`` lists sub-group s, and param group g holds the sub-groups
  ``optimizer_state_dict["param_groups"][g]["params"]``.

``deepspeed/utils/zero_to_fp32.py`` reads the weights this way and
``deepspeed/checkpoint/ds_to_universal.py`` the moments; both hold every rank file at
once. Here each parameter is a list of pieces (a saved tensor, an element range) and is
read a slice at a time (``torchfile``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..foreign import tag_folder
from .pieces import Param, as_int, frozen_params, stage3_params, stage12_params
from .torchfile import Lazy, read_structure

_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


@dataclass
class Checkpoint:
    """A DeepSpeed checkpoint's parameters (module order), buffers, and optimizer groups
    (settings, and the names of their parameters)."""

    folder: Path
    zero_stage: int
    world: int
    ds_version: str
    global_steps: int
    compute_dtype: torch.dtype
    params: list[Param]
    buffers: dict[str, Lazy]
    groups: list[dict]


def _optim_files(folder: Path) -> dict[int, Path]:
    """Data-parallel rank -> its optimizer file; other parallelisms' files are refused."""
    files, other = {}, []
    for p in sorted(folder.glob("*_optim_states.pt")):
        m = _OPTIM.match(p.name)
        if not m:
            other.append(p.name)
        elif int(m.group(3)) != 0:
            raise NotImplementedError(f"{p}: tensor-parallel rank {int(m.group(3))}; only "
                                      "data-parallel ZeRO checkpoints (mp_rank_00) are read")
        else:
            files[int(m.group(2))] = p
    if other:
        raise NotImplementedError(f"{folder / other[0]}: expert (MoE) optimizer files are "
                                  "not read; only data-parallel ZeRO checkpoints")
    if not files:
        raise ValueError(f"{folder}: no *_optim_states.pt files (saved without the ZeRO "
                         "optimizer?); the fp32 weights and Adam state live in them")
    return files


@dataclass(frozen=True)
class _Kind:
    """How a DeepSpeed ZeRO stage lays out its files (see the note)."""

    model_file: str  # the model-states file, ``{}`` the rank where there is one per rank
    partitioned: bool  # parameters partitioned one by one (stage 3), not flat groups
    cut: object  # the function that cuts the partitions into parameters


#: DeepSpeed's ZeRO stage number -> its layout; stages 1 and 2 share one class
#: (``runtime/zero/stage_1_and_2.py``), and so one layout. bf16 with fp32 gradient
#: accumulation at stage 1 runs DeepSpeed's BF16_Optimizer instead, whose files record no
#: stage (``runtime/bf16_optimizer.py`` ``state_dict``; ``runtime/engine.py``
#: ``_do_optimizer_sanity_check``): the same flat layout, saved uncut.
KINDS = {1: _Kind("mp_rank_00_model_states.pt", False, stage12_params),
         2: _Kind("mp_rank_00_model_states.pt", False, stage12_params),
         3: _Kind("zero_pp_rank_{}_mp_rank_00_model_states.pt", True, stage3_params),
         "bf16": _Kind("mp_rank_00_model_states.pt", False,
                       functools.partial(stage12_params, cut=False))}


def _optimizer_states(folder: Path) -> tuple[int | str, int, list[dict]]:
    """(DeepSpeed's ZeRO stage or "bf16", N, each rank's ``optimizer_state_dict``) of a
    tag folder."""
    files = _optim_files(folder)
    optim = {r: read_structure(p).get("optimizer_state_dict") for r, p in files.items()}
    for state in optim.values():  # (per-parameter addresses, not needed: kept small)
        if isinstance(state, dict):
            state.pop("param_slice_mappings", None)
    first = optim[min(optim)]
    if not isinstance(first, dict) or not {"zero_stage", "single_partition_of_fp32_groups"} \
            & set(first):
        raise ValueError(f"{files[min(files)]}: no ZeRO optimizer state (zero_stage) in it")
    zero_stage = as_int(first["zero_stage"]) if "zero_stage" in first else "bf16"
    if zero_stage not in KINDS:
        raise NotImplementedError(f"{folder}: ZeRO stage {zero_stage}; stages 1, 2 and 3 "
                                  "are read")
    counts = first["partition_count"]
    counts = counts if isinstance(counts, list) else [counts]
    world = as_int(counts[0])
    if any(as_int(c) != world for c in counts):
        raise NotImplementedError(f"{folder}: param groups partitioned over {counts} ranks "
                                  "(expert parallelism); one data-parallel group is read")
    missing, extra = sorted(set(range(world)) - set(files)), sorted(set(files) - set(range(world)))
    if missing:
        raise ValueError(f"{folder}: {len(files)} optimizer files for {world} ranks; missing "
                         f"ranks {missing} (a save that did not finish on every rank?)")
    if extra:
        raise ValueError(f"{folder}: optimizer files of ranks {extra}, beyond the {world} the "
                         "files name (left there by a save at another N?)")
    if "ds_zero_partition_groups" in first:
        raise NotImplementedError(f"{folder}: AutoEP partition groups are not read")
    return zero_stage, world, [optim[r] for r in range(world)]


def read(path: str | Path, tag: str | None = None) -> Checkpoint:
    """The layout of the DeepSpeed checkpoint at ``path`` (``latest``'s tag, or ``tag``);
    reads the files' structure, not their tensors."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no such folder")
    folder = tag_folder(path, tag)
    latest = path / "latest"
    ours = [f for f in (path, path / latest.read_text(errors="replace").strip()
                        if latest.is_file() else path) if (f / "manifest.json").is_file()]
    if folder is None and ours:
        raise ValueError(f"{path} is a zeroshard checkpoint ({ours[0]} holds its "
                         "manifest.json), not a DeepSpeed one: zs.load and --resume read it "
                         "as it is")
    if folder is None and tag is None and latest.is_file():
        named = latest.read_text(errors="replace").strip()
        tags = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise ValueError(f"{latest} names the tag {named!r}, but {path / named} holds no "
                         f"DeepSpeed files (*_model_states.pt, *_optim_states.pt); the tag "
                         f"folders in {path}: {tags}: give one with --tag")
    if folder is None:
        raise ValueError(f"{path} is not a DeepSpeed checkpoint: no `latest` file naming a "
                         "tag folder, and no *_model_states.pt or *_optim_states.pt in it")
    if not folder.is_dir():
        tags = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise ValueError(f"tag={tag!r}: no folder {folder}; the tags in {path}: {tags}")
    zero_stage, world, states = _optimizer_states(folder)
    kind = KINDS[zero_stage]
    model_files = [folder / kind.model_file.format(r)
                   for r in range(world if kind.partitioned else 1)]
    for p in model_files:
        if not p.is_file():
            raise ValueError(f"{folder}: no {p.name}; the parameters' names and shapes are in it")
    model0 = read_structure(model_files[0])
    shapes = model0.get("param_shapes") if isinstance(model0, dict) else None
    if not shapes:
        raise ValueError(f"{model_files[0]}: a model-states file without param_shapes (saved "
                         "without a ZeRO optimizer?); the flat partitions cannot be cut into "
                         "parameters without the names and shapes")
    module = model0.get("module") or {}
    params, groups = kind.cut(shapes, states, world, folder)
    fragments = [model0.get("frozen_param_fragments") or {}]
    if kind.partitioned and model0.get("frozen_param_shapes"):
        # each rank's piece of a frozen parameter is in its own file; the rest is dropped
        fragments += [read_structure(p).get("frozen_param_fragments") or {}
                      for p in model_files[1:]]
    params += frozen_params(model0, fragments, {p.name for p in params}, kind.partitioned,
                            world)
    order = {n: k for k, n in enumerate(module)}
    params.sort(key=lambda p: order.get(p.name, len(order)))
    for g in groups:  # the names in module order, as an optimizer built from the model has them
        g["params"].sort(key=lambda n: order.get(n, len(order)))
    buffers = {n: module[n] for n in model0.get("buffer_names") or [] if n in module}
    dtypes = [t.dtype for t in module.values() if isinstance(t, Lazy) and t.dtype.is_floating_point]
    return Checkpoint(folder=folder, zero_stage=1 if zero_stage == "bf16" else zero_stage,
                      world=world,
                      ds_version=str(model0.get("ds_version", "?")),
                      global_steps=int(model0.get("global_steps", 0) or 0),
                      compute_dtype=dtypes[0] if dtypes else torch.float32,
                      params=params, buffers=buffers, groups=groups)
