"""``zero=`` of :class:`zeroshard.hf.Trainer`: the :class:`ZeroConfig` a Trainer shards
with, read from what the user gives and the ``TrainingArguments`` beside it.

A DeepSpeed config is read as the Trainer reads one for DeepSpeed
(``HfTrainerDeepSpeedConfig`` in ``transformers/integrations/deepspeed.py``): each
``"auto"`` value is filled from ``TrainingArguments`` (``trainer_config_process``), the
three ``zero_optimization`` sizes from the model's hidden size
(``trainer_config_finalize``), the scheduler's step counts once the number of training
steps is known; a value that is given and disagrees with ``TrainingArguments`` is a
mismatch, all of them named in one error. What remains goes through zeroshard's one
translator (``ZeroConfig.from_deepspeed``), which warns once about the keys it ignores.
Torch-free until the Trainer needs torch: only the optimizer is built elsewhere.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._jsonfile import read_json_object
from ..spec.config import ZeroConfig, is_deepspeed

#: What ``zero=`` accepts, for error lines.
ZERO_FORMS = ("a ZeroConfig, a dict of its fields, a DeepSpeed config dict, or the path of a "
              "JSON file holding either")

#: DeepSpeed's keys the Trainer acts on itself (batch sizes, clipping, the optimizer and
#: the scheduler), beside the engine's (``spec/deepspeed.py``); and two that only set
#: DeepSpeed's own logging, which the Trainer's ``logging_steps`` replaces.
TRAINER_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "train_batch_size", "gradient_clipping", "optimizer", "scheduler",
                "steps_per_print", "wall_clock_breakdown",
                # save_model() always writes whole weights: what this key turns on
                "zero_optimization.stage3_gather_16bit_weights_on_model_save")

#: DeepSpeed optimizer types built as torch optimizers (DeepSpeed's Adam is AdamW unless
#: ``adam_w_mode`` is false: ``deepspeed/runtime/engine.py``, ``_configure_basic_optimizer``).
DEEPSPEED_OPTIMIZERS = ("Adam", "AdamW")
#: DeepSpeed schedulers zeroshard.hf reproduces (``deepspeed/runtime/lr_schedules.py``).
DEEPSPEED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR")

#: The ``zero_optimization`` sizes the Trainer fills from the hidden size h.
_HIDDEN_KEYS = ("zero_optimization.reduce_bucket_size",
                "zero_optimization.stage3_prefetch_bucket_size",
                "zero_optimization.stage3_param_persistence_threshold")
#: Filled once the number of training steps is known (``create_scheduler``).
_LATE_KEYS = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps")


@dataclass(frozen=True)
class Resolved:
    """What ``zero=`` asks of the Trainer."""

    config: ZeroConfig
    """The engine's configuration."""
    optimizer: dict | None = None
    """A DeepSpeed ``optimizer`` section ("auto" filled), built in ``create_optimizer``."""
    scheduler: dict | None = None
    """A DeepSpeed ``scheduler`` section; its step counts may still be "auto"."""


def resolve(zero: Any, args, model) -> Resolved:
    """The configuration ``zero`` describes, its precision reconciled with ``args``:
    a precision ``zero`` leaves open (``None``, a dict without ``mixed_precision``,
    DeepSpeed's ``"auto"``) is taken from ``bf16=``; one it states must agree."""
    if zero is None:
        zero = {}
    if isinstance(zero, (str, Path)) and str(zero).strip():
        zero = read_json_object(zero, "zero=")
    if isinstance(zero, ZeroConfig):
        _check_precision(zero.mixed_precision, args, "zero=ZeroConfig(...)")
        return Resolved(zero)
    if not isinstance(zero, dict):
        raise ValueError(f"zero={_short(zero)}; expected {ZERO_FORMS}")
    if is_deepspeed(zero) or any(k in zero for k in TRAINER_KEYS):
        return _from_deepspeed(zero, args, model)
    fields = dict(zero)
    if "mixed_precision" in fields:
        _check_precision(fields["mixed_precision"], args, "zero=")
    else:
        fields["mixed_precision"] = "bf16" if args.bf16 else None
    return Resolved(ZeroConfig.from_dict(fields))


def _check_precision(given, args, where: str) -> None:
    """``bf16=`` and the config's precision must agree (a Trainer's ``bf16=True`` means
    the engine's bf16 recipe: bf16 compute weights, an fp32 master)."""
    name = given.name if hasattr(given, "name") else given
    bf16 = isinstance(name, str) and name.startswith("bf16")
    if bf16 != bool(args.bf16):
        raise ValueError(
            f"{where} has mixed_precision={name!r} but TrainingArguments(bf16={args.bf16}): "
            "they must agree (bf16=True with mixed_precision='bf16', bf16=False with None "
            "or 'fp32'); leave mixed_precision out of zero= to take it from bf16=")


def _from_deepspeed(ds: dict, args, model) -> Resolved:
    """A DeepSpeed config with its "auto" values filled as the Trainer fills them."""
    ds = copy.deepcopy(ds)
    mismatches: list[str] = []
    for key, value, hf_key, must in _trainer_values(args):
        fill(ds, key, value, hf_key, mismatches, must)
    _fill_hidden(ds, model)
    if not _zero3(ds):  # DeepSpeed reads stage3_* at stage 3 only
        for key in _HIDDEN_KEYS[1:]:
            if _get(ds, key) == "auto":
                del ds["zero_optimization"][key.split(".")[1]]
    if mismatches:
        raise ValueError("DeepSpeed config values disagree with TrainingArguments: "
                         + "; ".join(mismatches) + " (set them to \"auto\" to take the "
                         "TrainingArguments' values)")
    left = [k for k in _auto_keys(ds) if k not in _LATE_KEYS]
    if left:
        raise ValueError(f"DeepSpeed config key {left[0]} is \"auto\", which only the "
                         "Trainer's own keys may be (batch sizes, clipping, the optimizer's "
                         "and the scheduler's params, bf16/fp16, the three hidden-size "
                         "zero_optimization sizes); give it a value")
    optimizer, scheduler = ds.get("optimizer"), ds.get("scheduler")
    _check_section(optimizer, "optimizer", DEEPSPEED_OPTIMIZERS)
    _check_section(scheduler, "scheduler", DEEPSPEED_SCHEDULERS)
    if ds.get("fp16", {}).get("enabled") is True:
        raise NotImplementedError(
            "fp16.enabled=true: zeroshard.hf.Trainer trains in fp32 or bf16 (fp16 needs "
            "zeroshard's loss scaler, which the Trainer's step does not drive); use bf16")
    config = ZeroConfig.from_deepspeed(ds, handled=TRAINER_KEYS)
    return Resolved(config, optimizer, scheduler)


def _trainer_values(args) -> list[tuple[str, Any, str, bool]]:
    """(DeepSpeed key, TrainingArguments' value, its name, must match), in the order of
    ``HfTrainerDeepSpeedConfig.trainer_config_process``."""
    total = args.world_size * args.per_device_train_batch_size * args.gradient_accumulation_steps
    return [
        ("train_micro_batch_size_per_gpu", args.per_device_train_batch_size,
         "per_device_train_batch_size", True),
        ("gradient_accumulation_steps", args.gradient_accumulation_steps,
         "gradient_accumulation_steps", True),
        ("train_batch_size", total, "train_batch_size (calculated)", True),
        ("gradient_clipping", args.max_grad_norm, "max_grad_norm", True),
        ("optimizer.params.lr", args.learning_rate, "learning_rate", True),
        ("optimizer.params.betas", [args.adam_beta1, args.adam_beta2],
         "adam_beta1+adam_beta2", True),
        ("optimizer.params.eps", args.adam_epsilon, "adam_epsilon", True),
        ("optimizer.params.weight_decay", args.weight_decay, "weight_decay", True),
        ("scheduler.params.warmup_min_lr", 0, "", False),
        ("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate", True),
        ("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval", True),
        ("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval", True),
    ]


def fill(ds: dict, key: str, value, hf_key: str, mismatches: list[str],
         must_match: bool = True) -> None:
    """``HfTrainerDeepSpeedConfig.fill_match``: "auto" becomes ``value``; a given value
    that differs is a mismatch (unless ``must_match`` is off). A key whose section is
    absent is left alone."""
    *parents, leaf = key.split(".")
    node = ds
    for p in parents:
        node = node.get(p) if isinstance(node, dict) else None
        if node is None:
            return
    if not isinstance(node, dict):
        return
    if node.get(leaf) == "auto":
        node[leaf] = value
    elif must_match and node.get(leaf) is not None and node[leaf] != value:
        mismatches.append(f"ds {key}={node[leaf]!r} vs hf {hf_key}={value!r}")


def _fill_hidden(ds: dict, model) -> None:
    """``trainer_config_finalize``'s sizes from the hidden size h: the reduce bucket h²,
    and at stage 3 the prefetch bucket 0.9·h² and the persistence threshold 10·h."""
    wanted = [k for k in _HIDDEN_KEYS if _get(ds, k) == "auto"]
    if not wanted:
        return
    h = _hidden_size(getattr(model, "config", None))
    if h is None:
        raise ValueError(f"DeepSpeed config keys {', '.join(wanted)} are \"auto\", but the "
                         "model's config has no hidden_size or hidden_sizes to fill them "
                         "from; give them values")
    unused: list[str] = []
    fill(ds, _HIDDEN_KEYS[0], h * h, "", unused, False)
    if _zero3(ds):
        fill(ds, _HIDDEN_KEYS[1], int(0.9 * h * h), "", unused, False)
        fill(ds, _HIDDEN_KEYS[2], 10 * h, "", unused, False)


def _zero3(ds: dict) -> bool:
    """``HfTrainerDeepSpeedConfig.is_zero3``, asked of the policy: whether the config's
    stage shards the parameters (an unreadable stage: no; the translator names it)."""
    try:
        return ZeroConfig(stage=_get(ds, "zero_optimization.stage") or 0).policy.shards_params
    except ValueError:
        return False


def _hidden_size(config) -> int | None:
    """The model's hidden size as the Trainer finds it (the largest of ``hidden_sizes``;
    a multimodal model's text config)."""
    for c in (config, getattr(config, "text_config", None)):
        if c is None:
            continue
        if getattr(c, "hidden_size", None) is not None:
            return c.hidden_size
        if getattr(c, "hidden_sizes", None):
            return max(c.hidden_sizes)
    return None


def fill_steps(section: dict, num_training_steps: int, warmup_steps: int) -> dict:
    """The scheduler section with ``total_num_steps`` and ``warmup_num_steps`` filled
    (``trainer_config_finalize``: warm-up at least 1 step); a mismatch is an error."""
    ds = {"scheduler": copy.deepcopy(section)}
    mismatches: list[str] = []
    fill(ds, "scheduler.params.total_num_steps", num_training_steps,
         "num_training_steps (calculated)", mismatches)
    fill(ds, "scheduler.params.warmup_num_steps", max(1, warmup_steps), "warmup_steps",
         mismatches)
    if mismatches:
        raise ValueError("DeepSpeed config values disagree with TrainingArguments: "
                         + "; ".join(mismatches))
    return ds["scheduler"]


def _check_section(section, name: str, known: tuple[str, ...]) -> None:
    if section is None:
        return
    if not isinstance(section, dict) or not isinstance(section.get("type"), str):
        raise ValueError(f"DeepSpeed config {name}={_short(section)} must be a JSON object "
                         'with a "type"')
    if not isinstance(section.get("params", {}), dict):
        raise ValueError(f"DeepSpeed config {name}.params must be a JSON object")
    if section["type"].lower() not in {k.lower() for k in known}:
        raise NotImplementedError(
            f"DeepSpeed config {name}.type={section['type']!r} is not built by "
            f"zeroshard.hf.Trainer; supported: {', '.join(known)} (or leave the {name} "
            "section out to use the TrainingArguments')")


def _get(ds: dict, key: str):
    node = ds
    for p in key.split("."):
        node = node.get(p) if isinstance(node, dict) else None
    return node


def _auto_keys(ds, prefix: str = "") -> list[str]:
    if not isinstance(ds, dict):
        return []
    out = []
    for k, v in ds.items():
        name = f"{prefix}{k}"
        out += [name] if v == "auto" else _auto_keys(v, name + ".")
    return out


def check_arguments(args, optimizers=(None, None), model_init=None) -> None:
    """Refuse, in one line each, what cannot go with ``zero=``: another engine named in
    ``TrainingArguments`` (``deepspeed=``, ``fsdp=``), what the Trainer would do to the
    model behind the engine's back (a dtype cast for evaluation, ``torch.compile`` through
    accelerate, re-creating it) and an optimizer built before sharding."""
    if args.deepspeed:
        raise ValueError(
            f"TrainingArguments(deepspeed={_short(args.deepspeed)}) beside zero=: DeepSpeed and "
            "zeroshard would both shard the model; give the DeepSpeed config as zero= "
            "(zero='ds.json') and leave deepspeed= unset")
    if args.fsdp:
        raise ValueError(
            f"TrainingArguments(fsdp={_short(args.fsdp)}) beside zero=: FSDP and zeroshard "
            "would both shard the model; leave fsdp= unset (zero=ZeroConfig(stage=3) is "
            "ZeRO-3, FSDP's sharding)")
    if args.fp16:
        raise NotImplementedError(
            "TrainingArguments(fp16=True) with zero=: zeroshard.hf.Trainer trains in fp32 or "
            "bf16 (fp16 needs zeroshard's loss scaler, which the Trainer's step does not "
            "drive); use bf16=True")
    for name in ("bf16_full_eval", "fp16_full_eval", "torch_compile", "auto_find_batch_size"):
        if getattr(args, name, False):
            raise NotImplementedError(
                f"TrainingArguments({name}=True) with zero=: it would cast, compile or "
                "rebuild the model behind the engine that shards it; leave it False")
    if getattr(args, "parallelism_config", None) is not None:
        raise NotImplementedError(
            "TrainingArguments(parallelism_config=...) with zero=: accelerate's tensor, "
            "context and sequence parallelism do not compose with zeroshard.hf.Trainer")
    if model_init is not None:
        raise NotImplementedError(
            "model_init= with zero=: zeroshard.hf.Trainer shards the model it is given; "
            "pass model= (hyperparameter search, which rebuilds the model, is not supported)")
    if optimizers is not None and optimizers[0] is not None:
        raise ValueError(
            f"optimizers=({type(optimizers[0]).__name__}, ...) with zero=: an optimizer "
            "built before sharding holds the unsharded parameters; give its class and "
            "arguments as optimizer_cls_and_kwargs=, or optim=, and the Trainer builds it "
            "over the shards")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
