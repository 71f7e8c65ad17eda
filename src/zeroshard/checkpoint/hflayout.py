"""The Hugging Face layout in and out: a model folder's weight files found
(``weight_files``), a sharded model initialised from them (each rank reading only the
rows it keeps, one unit at a time), and a checkpoint of such a model exported back into
a folder ``from_pretrained`` loads.

Names: the model's parameters carry transformers' own names (``model.layers.0...``,
``transformer.h.0...``), which is mostly what ``save_pretrained`` writes. Where a file's
key differs, it is renamed as transformers renames it on load (its conversion mapping:
GPT-NeoX's ``embed_out.`` is the model's ``lm_head.``), and older files that name the
base model's tensors without its prefix (GPT-2's ``h.0.attn.c_attn.weight`` for
``transformer.h.0.attn.c_attn.weight``) are found as ``from_pretrained`` finds them.
An export writes the model's own names, which ``from_pretrained`` takes as they are. A
weight tied to another (GPT-2's head, a small Llama's) is one parameter of the model and
one tensor of the files.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from .._jsonfile import read_json_object
from .exportdir import INDEX, SINGLE, put
from .load import _agree, base_model
from .sharded import entries, read_manifest, resolve
from .tensorfile import TensorFile, fsync_dir
from .tplayout import read_whole

#: The files of a model folder besides its weights that an export carries over: the
#: config, the generation settings and the tokenizer in every form transformers writes.
CARRIED = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
           "added_tokens.json", "vocab.*", "merges.txt", "spiece.model", "chat_template.*",
           "preprocessor_config.json")


def _renames(module) -> tuple[list, bool]:
    """transformers' own renames of checkpoint keys for ``module`` (e.g. GPT-NeoX's
    ``embed_out.`` -> ``lm_head.``, old files' ``gamma``/``beta``), and whether it also
    converts tensors on load (merges, splits), which a read of rows cannot follow."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # a transformers without conversion mappings renames nothing
        return [], False
    transforms = get_model_conversion_mapping(module)
    renames = [t for t in transforms if type(t) is WeightRenaming]
    return renames, len(renames) < len(transforms)


def _source_names(model, wmap: dict[str, Path]) -> tuple[dict[str, str], bool]:
    """The model's tensor name -> the name in the files (as transformers renames keys on
    load, or without the base model's prefix); and whether transformers would convert
    some tensors besides. A peft model (``zeroshard train --lora``) is read as its base
    model: each name without peft's additions, its adapters not in the files."""
    module, names = base_model(model.module)
    prefix = getattr(module, "base_model_prefix", "") or ""
    wanted = {names(n): n for n, _ in [*model.module.named_parameters(),
                                       *model.module.named_buffers()] if names(n)}
    renames, converts = _renames(module)
    out: dict[str, str] = {}
    for key in wmap:
        name = key
        for t in renames:
            name, _ = t.rename_source_key(name)
        if name not in wanted and prefix and f"{prefix}.{name}" in wanted:
            name = f"{prefix}.{name}"
        if name in wanted:
            out.setdefault(wanted[name], key)
    return out, converts


#: What peft adds to a base model's names: its wrapper's prefix, and the name each
#: adapted layer keeps its base under (``peft/tuners/lora/layer.py``: ``base_layer``).
def weight_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, in the model folder ``path``: from
    the index or the single file. A problem is one line naming the folder as
    ``hf_model``."""
    p = Path(path)
    if (p / INDEX).is_file():
        wmap = read_json_object(p / INDEX, "index").get("weight_map")
        if not isinstance(wmap, dict) or not all(isinstance(f, str) for f in wmap.values()):
            raise ValueError(f"{p / INDEX}: no weight_map of tensor names to files")
        missing = sorted({f for f in wmap.values() if not (p / f).is_file()})
        if missing:
            raise ValueError(f"{_where(path)}: {p / missing[0]}, named by {INDEX}, is missing")
        return {n: p / f for n, f in wmap.items()}
    if (p / SINGLE).is_file():
        try:
            return dict.fromkeys(TensorFile(str(p / SINGLE)).keys(), p / SINGLE)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{_where(path)}: {p / SINGLE} cannot be read as safetensors "
                             f"({_first_line(exc)})") from None
    others = sorted(q.name for q in p.glob("*.bin")) + sorted(q.name for q in p.glob("*.pth"))
    also = f" ({others[0]} is not read: save the model with safe_serialization)" if others \
        else ""
    raise ValueError(f"{_where(path)}: no {SINGLE} and no {INDEX}: the weights are "
                     f"missing{also}")


def _where(path: str | Path) -> str:
    return f"hf_model={str(path)!r}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def load_hf_weights(model, path: str | Path) -> None:
    """Initialise a ShardedModel built from ``path``'s config with ``path``'s weights: per
    unit, each rank reads the rows it keeps (its shard; the whole parameter where it is
    kept whole) and nothing else. Every file is checked (names, shapes) on every rank and
    the ranks agree before anything is written; a problem is one line naming the file."""
    problem, plan = None, []
    try:
        wmap = weight_files(path)
        names, converts = _source_names(model, wmap)
        handles: dict[Path, TensorFile] = {}
        base = base_model(model.module)[1]
        for e in entries(model):
            if base(e.name) is None:
                continue  # an adapter: initialised at shard time (train/peftmodel.py)
            if e.name not in names:
                why = ("transformers converts this model's checkpoint tensors on load, which "
                       "reading rows cannot follow; save it with this transformers version "
                       "first" if converts else "saved from another architecture or config?")
                raise ValueError(f"{path}: no tensor {e.name!r} in the weights for the model's "
                                 f"parameter ({why})")
            file = wmap[names[e.name]]
            f = handles[file] = handles.get(file) or TensorFile(str(file))  # a header once
            if f.shape(names[e.name]) != e.shape:
                raise ValueError(f"{file}: {names[e.name]!r} has shape "
                                 f"{f.shape(names[e.name])}, the model {e.shape} (config.json "
                                 "and the weights disagree)")
            plan.append((e, f, names[e.name]))
        for n, _ in model.module.named_buffers():
            if n in names and wmap[names[n]] not in handles:
                handles[wmap[names[n]]] = TensorFile(str(wmap[names[n]]))
        buffers = [(buf, handles[wmap[names[n]]], names[n])
                   for n, buf in model.module.named_buffers() if n in names]
    except ValueError as exc:
        problem = str(exc)
    except OSError as exc:  # a file the index names is unreadable
        problem = f"{exc.filename or path}: {exc.strerror or exc}"
    _agree(model, problem)
    by_unit: dict[int, list] = {}
    for item in plan:  # unit by unit: one unit's rows in flight at a time
        by_unit.setdefault(id(item[0].unit), []).append(item)
    with torch.no_grad():
        for items in by_unit.values():
            for e, f, source in items:
                a, b = e.held()
                if a < b:  # (this tp rank's slice beside tensor parallelism)
                    e.local(a, b).copy_(read_whole(f, source, e, a, b))
        for buf, f, source in buffers:
            buf.copy_(f.rows(source))
    model.refresh_compute()
    dist.barrier(model.mesh.control_group)


def trained_from(ckpt_path: str | Path) -> str | None:
    """The Hugging Face model folder a ``zeroshard train --hf-model`` checkpoint was
    trained from (None for any other checkpoint)."""
    ckpt = resolve(ckpt_path)
    config = read_manifest(ckpt)["extra"].get("config") or {}
    return config.get("hf_model") if isinstance(config, dict) else None


def carried_files(source: str | Path) -> list[Path]:
    """The files of ``source`` an export copies: config, generation config, tokenizer."""
    return sorted(p for p in Path(source).iterdir() if p.is_file()
                  and any(fnmatch.fnmatch(p.name, pattern) for pattern in CARRIED))


def check_export(source: str | Path, out: str | Path) -> None:
    """An export of a model trained from ``source`` into ``out``: ``source`` still holds
    its config (copied into the export), and ``out`` is another folder."""
    src = Path(source)
    if not (src / "config.json").is_file():
        raise ValueError(f"the checkpoint was trained from {source}, which no longer holds "
                         "config.json; the export copies it and the tokenizer from there "
                         "(restore the folder, or export weights only from a copy)")
    if Path(out).exists() and Path(out).resolve() == src.resolve():
        raise ValueError(f"out={str(out)!r} is the model folder the run was trained from; "
                         "export into another folder (its weights would be replaced)")


def carry_over(source: str | Path, out: str | Path, dtype: str) -> list[str]:
    """Copy ``source``'s config, generation config and tokenizer into ``out``, each
    written aside and moved in whole (``exportdir.put``: the export's to replace next
    time). ``config.json``'s dtype is set to the exported one, so ``from_pretrained``
    loads the weights as written."""
    out = Path(out)
    copied = []
    for p in carried_files(source):
        if p.name == "config.json":
            config = json.loads(p.read_text(encoding="utf-8"))
            name = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
            for key in ("torch_dtype", "dtype"):
                if key in config:
                    config[key] = name
            text = json.dumps(config, indent=2, sort_keys=True) + "\n"
            put(out, p.name, lambda tmp, text=text: tmp.write_text(text, encoding="utf-8"))
        else:
            put(out, p.name, lambda tmp, p=p: shutil.copyfile(p, tmp))
        copied.append(p.name)
    fsync_dir(str(out))
    return copied
