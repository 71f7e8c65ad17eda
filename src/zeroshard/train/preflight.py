"""Every path of a ``zeroshard train`` run, and the memory its processes need, checked
before any process starts.

A path that cannot serve the run used to be found where it was first used: a
``--profile`` folder that is a file after every step had been trained, a ``--json-log``
in a missing folder as a traceback on every rank, a checkpoint of another model after
the ranks had built theirs. Each is found here instead, as one line naming the setting,
the path and the problem; the ranks check again as they read (under ``torchrun`` they
start without this launcher, so theirs are the only checks).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from .._paths import claim, folder, output_file
from . import hostmem
from .peftmodel import check_compile
from .resume import checkpoint_to_resume, weights_checkpoint
from .settings import TrainConfig


def _same_model(where: str, found: dict[str, tuple[int, ...]],
                shapes: dict[str, tuple[int, ...]], source) -> None:
    """``found`` (name -> shape in a file) holds the model's parameters exactly."""
    hint = ("give the --hf-model it was trained from" if source.source else
            "give the --model it was trained as")
    for name, shape in shapes.items():
        if name not in found:
            raise ValueError(f"{where}: not a {source.label} (no tensor {name!r}); {hint}")
        if tuple(found[name]) != shape:
            raise ValueError(f"{where}: not a {source.label} ({name!r} has shape "
                             f"{tuple(found[name])}, the model {shape}); {hint}")


def resume(cfg: TrainConfig, shapes: dict[str, tuple[int, ...]], source) -> int:
    """The checkpoint to resume: found, of this model, saved by the trainer, and short of
    ``steps`` (for "auto", a run trained to its end already is done, not wrong). Returns
    its step."""
    from ..checkpoint.sharded import read_manifest, resolve

    ckpt = resolve(checkpoint_to_resume(cfg))
    manifest = read_manifest(ckpt)
    _same_adapters(cfg, ckpt, manifest["extra"].get("config"))
    _same_model(str(ckpt), {n: p["shape"] for n, p in manifest["params"].items()}, shapes,
                source)
    extra = manifest["extra"]
    if not {"step", "scheduler"} <= set(extra):
        raise ValueError(f"resume={cfg.resume!r}: {ckpt} was not saved by zeroshard train (no "
                         "step and schedule); start from its weights with --init-from after "
                         "`zeroshard export`")
    done = int(extra["step"])
    if done >= cfg.steps and cfg.resume != "auto":
        raise ValueError(f"resume={cfg.resume!r}: {ckpt} is at step {done} and steps="
                         f"{cfg.steps}: nothing to train; give --steps above {done} (the "
                         "total, counting the steps already trained)")
    return done


def _same_adapters(cfg: TrainConfig, ckpt: Path, saved) -> None:
    """A run resumes with the adapters its checkpoint was trained with: a LoRA checkpoint
    with ``--lora``, a plain one without (whose weights start LoRA fine-tuning through
    ``--init-from``)."""
    saved_rank = saved.get("lora") if isinstance(saved, dict) else None
    if saved_rank and cfg.lora is None:
        raise ValueError(f"resume={cfg.resume!r}: {ckpt} was trained with LoRA r={saved_rank} "
                         f"adapters; resume it with lora={saved_rank} (and its lora_targets), "
                         "or merge them (zeroshard export --merge) and start from the merged "
                         "weights with init_from")
    if cfg.lora is not None and isinstance(saved, dict) and not saved_rank:
        raise ValueError(f"resume={cfg.resume!r}: {ckpt} was trained without adapters, and "
                         f"lora={cfg.lora} adds them; to fine-tune its weights with LoRA, "
                         f"start from them: init_from={str(ckpt)!r} (not resume)")


def init_from(cfg: TrainConfig, shapes: dict[str, tuple[int, ...]], source) -> None:
    """The weights to start from: safetensors (a file, or a folder with an export), or a
    zeroshard checkpoint (its weights alone), holding this model's parameters — a LoRA
    run's base model's, under the base model's names."""
    from ..checkpoint.consolidated import _weight_map
    from ..checkpoint.load import peft_base_name
    from ..checkpoint.tensorfile import TensorFile

    path = Path(cfg.init_from)
    if not path.exists():
        raise ValueError(f"init_from={cfg.init_from!r}: no such file or folder")
    if cfg.lora is not None:  # the files hold the base model, the adapters start fresh
        shapes = {peft_base_name(n): s for n, s in shapes.items() if peft_base_name(n)}
    if weights_checkpoint(path):
        from ..checkpoint.sharded import read_manifest, resolve

        ckpt = resolve(path)
        found = {n: tuple(p["shape"]) for n, p in read_manifest(ckpt)["params"].items()}
        return _same_model(f"init_from={cfg.init_from!r}", found, shapes, source)
    try:
        wmap = _weight_map(path)
        found, opened = {}, {}
        for name in shapes:
            if name in wmap:
                f = opened[wmap[name]] = opened.get(wmap[name]) or TensorFile(str(wmap[name]))
                found[name] = f.shape(name)
    except OSError as exc:  # a shard the index names is missing or unreadable
        raise ValueError(f"init_from={cfg.init_from!r}: {exc.filename or cfg.init_from} "
                         f"cannot be read ({exc.strerror or exc})") from None
    _same_model(f"init_from={cfg.init_from!r}", found, shapes, source)


def _save_dir(cfg: TrainConfig, shapes: dict[str, tuple[int, ...]]):
    """The save folder checked (writable, room for a checkpoint beside the last) and
    held for the run (``checkpoint/savedir.py``)."""
    from ..checkpoint import savedir

    if not cfg.save_dir:
        return contextlib.nullcontext()
    params = 0
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        params += n
    from .save import save_due

    savedir.check(cfg.save_dir, 2 * savedir.checkpoint_bytes(params, cfg.zero.recipe),
                  lambda step: save_due(cfg, step), cfg.steps)
    return savedir.hold(cfg.save_dir)


def check(cfg: TrainConfig, source=None):
    """Check the model (``source``, by default ``cfg``'s: a Hugging Face folder is read,
    the sequence length checked against it) and every path of ``cfg``; return the
    context that holds the save folder for the run."""
    from .board import check as tensorboard
    from .hfmodel import model_source

    source = source or model_source(cfg)
    if cfg.tp > 1:  # the heads and widths the plan splits (the ranks check again)
        from ..spec.dims import check_tp_degree

        check_tp_degree(cfg.tp, source.label, source.tp_sizes())
    shapes = source.shapes()  # the model with --lora's adapters: their rules checked
    check_compile(cfg.compile)
    if cfg.hf_model and cfg.sample_chars:
        source.tokenizer()
    if checkpoint_to_resume(cfg) is not None:
        resume(cfg, shapes, source)
    if cfg.init_from:
        init_from(cfg, shapes, source)
    if cfg.json_log:
        output_file("json_log", cfg.json_log)
    if cfg.profile:
        from .profile import PROFILE_FILES, PROFILE_PATTERNS

        folder("profile", cfg.profile)
        claim("profile", cfg.profile, PROFILE_FILES, PROFILE_PATTERNS)
        try:
            source.architecture()
        except ValueError as exc:
            raise ValueError(f"profile: the planner cannot describe this model to set its "
                             f"plan beside the measurement ({exc}); run without --profile") \
                from None
    if cfg.tensorboard:
        tensorboard(cfg.tensorboard)
    hostmem.check(cfg, source)  # the processes' bytes against this machine's memory
    return _save_dir(cfg, shapes)
