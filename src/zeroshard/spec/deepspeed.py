"""DeepSpeed's config, read into ``ZeroConfig``'s fields: the keys the engine honours,
the sections it reads, and the one warning that names every other key."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

#: The DeepSpeed keys the engine honours -> the ZeroConfig field each sets (the trainer
#: honours a few more: ``zeroshard.train.settings``).
DEEPSPEED_KEYS = {
    "zero_optimization.stage": "stage",
    "bf16.enabled": "mixed_precision",
    "fp16.enabled": "mixed_precision",  # the scaler's: zs.GradScaler.from_deepspeed
    "zero_optimization.stage3_param_persistence_threshold": "param_persistence_threshold",
    "zero_optimization.stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "zero_optimization.reduce_bucket_size": "reduce_bucket_size",
    "zero_optimization.mics_shard_size": "shard_group",
    "zero_optimization.zero_hpz_partition_size": "secondary_group",
    "zero_optimization.zero_quantized_weights": "quantize_weights",
    "zero_optimization.zero_quantized_gradients": "quantize_grads",
    "zero_optimization.sub_group_size": "sub_group_size",
}
#: DeepSpeed's fp16 keys (``deepspeed.runtime.constants``) with DeepSpeed's defaults: the
#: loss scaler's (``zs.GradScaler.from_deepspeed``), not the engine's.
DEEPSPEED_FP16 = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                  "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1}
#: DeepSpeed's defaults for its Adam (``deepspeed.ops.adam.FusedAdam``), where torch's
#: differ (AdamW's weight decay is 0.01 in torch, 0 in DeepSpeed): read by the Trainer's
#: integration (``hf/schedules.py``) and the trainer's ``optimizer`` section
#: (``train/optimizer.py``).
DEEPSPEED_ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
#: The keys of DeepSpeed's fp16 block that set loss scaling (all but ``enabled``).
SCALER_KEYS = tuple(DEEPSPEED_FP16)
#: DeepSpeed's offload sections (``zero_optimization.offload_*``): read by
#: :func:`deepspeed_offload` into ``offload`` and ``offload_dir``.
_OFFLOAD_KEYS = ("zero_optimization.offload_optimizer", "zero_optimization.offload_param")
#: DeepSpeed's activation checkpointing section: present, it asks for checkpointing
#: ("full"; ``cpu_checkpointing``: "full+offload"); its other keys (``partition_activations``
#: splits the checkpoints over model-parallel ranks, ``contiguous_memory_optimization``,
#: ``number_checkpoints``, ``synchronize_checkpoint_boundary``, ``profile``) are named in
#: the warning.
_CHECKPOINTING = "activation_checkpointing"
_DEEPSPEED_SECTIONS = ("zero_optimization", "bf16", "fp16", _CHECKPOINTING)


def is_deepspeed(d: dict) -> bool:
    """Whether a config dict is DeepSpeed's (it has one of the sections the engine reads;
    ``activation_checkpointing`` as a section, where zeroshard's field is a mode)."""
    return any(s in d for s in _DEEPSPEED_SECTIONS[:-1]) or isinstance(d.get(_CHECKPOINTING),
                                                                       dict)


def fields_set(d: dict) -> dict[str, str]:
    """The ZeroConfig fields DeepSpeed config ``d`` sets, each with the key that sets it
    (for a file that gives a field twice: in DeepSpeed's words and in zeroshard's)."""
    out = {}
    for key, name in DEEPSPEED_KEYS.items():
        section, _, leaf = key.partition(".")
        if isinstance(d.get(section), dict) and leaf in d[section]:
            out.setdefault(name, key)
    zero = d.get("zero_optimization")
    for key in _OFFLOAD_KEYS:
        if isinstance(zero, dict) and key.partition(".")[2] in zero:
            out.setdefault("offload", key)
            out.setdefault("offload_dir", key)
    if _CHECKPOINTING in d:
        out.setdefault("activation_checkpointing", _CHECKPOINTING)
    return out


def translate(d: dict, handled: Iterable[str], make: Callable):
    """``make(**fields)`` (ZeroConfig) with the fields read from DeepSpeed's config ``d``; a
    bad value's error names its DeepSpeed key."""
    sections = {}
    for name in _DEEPSPEED_SECTIONS:
        sections[name] = d.get(name, {})
        if not isinstance(sections[name], dict):
            mode = " (zeroshard's activation_checkpointing mode goes in a zeroshard config)" \
                if name == _CHECKPOINTING else ""
            raise ValueError(f"{name}={sections[name]!r} must be a JSON object{mode}")
    handled = set(handled) | set(_OFFLOAD_KEYS) | {f"{_CHECKPOINTING}.cpu_checkpointing"}
    ignored = sorted(
        [f"{s}.{k}" for s in _DEEPSPEED_SECTIONS for k in sections[s]
         if f"{s}.{k}" not in DEEPSPEED_KEYS and f"{s}.{k}" not in handled]
        + [k for k in d if k not in _DEEPSPEED_SECTIONS and k not in handled])
    scaler = [k for k in ignored if k.startswith("fp16.") and k[5:] in SCALER_KEYS
              and sections["fp16"].get("enabled") is True]
    ignored = [k for k in ignored if k not in scaler]
    if ignored:
        warnings.warn(f"DeepSpeed config keys ignored by zeroshard: {', '.join(ignored)}",
                      stacklevel=4)
    if scaler:  # the loss scaler is an object of its own, as torch's GradScaler is
        warnings.warn(f"DeepSpeed config keys {', '.join(scaler)} are the loss scaler's: "
                      "pass the config to zs.GradScaler.from_deepspeed(model, config)",
                      stacklevel=4)
    kwargs = {"stage": 0, **deepspeed_offload(sections["zero_optimization"]),
              **deepspeed_checkpointing(d)}
    for key, name in DEEPSPEED_KEYS.items():
        section, _, leaf = key.partition(".")
        if leaf in sections[section] and name != "mixed_precision":
            kwargs[name] = sections[section][leaf]
    enabled = {}
    for half in ("bf16", "fp16"):
        enabled[half] = sections[half].get("enabled", False)
        if not isinstance(enabled[half], bool):
            raise ValueError(f"{half}.enabled={enabled[half]!r} must be true or false")
    if enabled["bf16"] and enabled["fp16"]:
        raise ValueError("bf16.enabled and fp16.enabled are both true; enable one")
    kwargs["mixed_precision"] = next((h for h in ("bf16", "fp16") if enabled[h]), None)
    for name in ("param_persistence_threshold", "prefetch_bucket_size",
                 "reduce_bucket_size", "sub_group_size"):  # sizes written as 5e8
        v = kwargs.get(name)
        if isinstance(v, float) and v.is_integer():
            kwargs[name] = int(v)
    if kwargs.get("shard_group") == -1:  # DeepSpeed's default: MiCS off
        del kwargs["shard_group"]
    if kwargs.get("secondary_group") == 1:  # DeepSpeed's default: hpZ off
        del kwargs["secondary_group"]
    try:
        return make(**kwargs)
    except ValueError as exc:  # name the DeepSpeed key the value came from
        message = str(exc).replace("offload_dir=",
                                   "zero_optimization.offload_optimizer.nvme_path=", 1)
        for key, name in DEEPSPEED_KEYS.items():
            if message.startswith(f"{name}="):
                message = key + message[len(name):]
                break
        raise ValueError(message) from None


def deepspeed_checkpointing(d: dict) -> dict:
    """``activation_checkpointing`` from DeepSpeed's section of that name: "full" where it
    is given, "full+offload" with ``cpu_checkpointing`` (the checkpoints in host memory)."""
    if _CHECKPOINTING not in d:
        return {}
    cpu = d[_CHECKPOINTING].get("cpu_checkpointing", False)
    if not isinstance(cpu, bool):
        raise ValueError(f"{_CHECKPOINTING}.cpu_checkpointing={cpu!r} must be true or false")
    return {"activation_checkpointing": "full+offload" if cpu else "full"}


def deepspeed_offload(zero: dict) -> dict:
    """``offload``/``offload_dir`` from DeepSpeed's ``offload_optimizer`` and
    ``offload_param`` sections: device "cpu" is host memory, "nvme" files under
    ``nvme_path`` (the optimizer's only), "none" or no section is no offload."""
    out = {}
    for section, mode in (("offload_optimizer", "optimizer"), ("offload_param", "params")):
        block = zero.get(section)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise ValueError(f"zero_optimization.{section}={block!r} must be a JSON object")
        device = block.get("device", "none")
        if device not in ("none", "cpu", "nvme") or (device == "nvme" and mode == "params"):
            accepted = "'none', 'cpu' or 'nvme'" if mode == "optimizer" else "'none' or 'cpu'"
            raise ValueError(f"zero_optimization.{section}.device={device!r}; expected "
                             f"{accepted}")
        if device == "none":
            continue
        out["offload"] = mode
        if device == "nvme":
            if "nvme_path" not in block:
                raise ValueError(f"zero_optimization.{section}.device='nvme' needs nvme_path "
                                 "(the directory the optimizer state is written to)")
            out["offload_dir"] = block["nvme_path"]
    return out
