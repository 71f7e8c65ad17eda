"""The learning rate's schedule of ``zeroshard train`` (and of the steps ``zeroshard
verify`` checks), and DeepSpeed's ``scheduler`` section read into its settings.

A warm-up of ``warmup`` steps (linear, or DeepSpeed's logarithmic one) from
``warmup_start_ratio × lr`` to ``lr``, then a decay over the steps to ``decay_steps``
(default: the run's last) down to ``min_lr_ratio × lr``: cosine, linear, or none
(``constant``). The factor at step s (counted from 0) is what torch's ``LambdaLR``
multiplies ``lr`` by.

DeepSpeed's schedulers (``deepspeed/runtime/lr_schedules.py``) map onto it:
``WarmupLR`` is ``constant``; ``WarmupDecayLR`` is ``linear`` to 0 at its
``total_num_steps``; ``WarmupCosineLR`` is ``cosine`` to its ``cos_min_ratio``. Their
linear warm-up runs ``s / W`` of the way at step s, so that DeepSpeed's first step trains
at ``warmup_min_lr`` (0 by default: a step that changes nothing); zeroshard's runs
``(s + 1) / W``, the same ramp a step earlier, its last warm-up step at ``lr``.
"""

from __future__ import annotations

import math

#: The decays after the warm-up.
SCHEDULES = ("cosine", "linear", "constant")
#: The warm-ups: linear, or DeepSpeed's logarithmic ``log(s + 1) / log(W)``.
WARMUPS = ("linear", "log")


def check_schedule(cfg) -> None:
    """The schedule's settings, each against what it can be."""
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"schedule={cfg.schedule!r}; expected one of {', '.join(SCHEDULES)}")
    if cfg.warmup_type not in WARMUPS:
        raise ValueError(f"warmup_type={cfg.warmup_type!r}; expected one of "
                         f"{', '.join(WARMUPS)}")
    for name in ("min_lr_ratio", "warmup_start_ratio"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"{name}={value!r}; expected a number from 0 to 1 (a share of lr)")
    if cfg.decay_steps is not None and (isinstance(cfg.decay_steps, bool)
                                        or not isinstance(cfg.decay_steps, int)
                                        or cfg.decay_steps < 1):
        raise ValueError(f"decay_steps={cfg.decay_steps!r}; expected a positive integer (the "
                         "step the decay ends at) or null for the run's last")


def warmup_steps(cfg) -> int:
    return cfg.warmup if cfg.warmup is not None else max(1, cfg.steps // 10)


def lr_lambda(cfg):
    """The factor of ``lr`` at each step (torch's ``LambdaLR``'s function)."""
    warmup, start, low = warmup_steps(cfg), cfg.warmup_start_ratio, cfg.min_lr_ratio
    end = cfg.decay_steps if cfg.decay_steps is not None else cfg.steps

    def f(step: int) -> float:
        if step < warmup:
            ramp = ((step + 1) / warmup if cfg.warmup_type == "linear"
                    else math.log(step + 1) / math.log(warmup) if warmup > 1 else 1.0)
            return start + (1 - start) * ramp
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, end - warmup))
        shape = (0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine"
                 else 1.0 - progress)
        return low + (1 - low) * shape

    return f


#: DeepSpeed's scheduler types -> zeroshard's decay.
_DEEPSPEED_TYPES = {"warmuplr": "constant", "warmupdecaylr": "linear",
                    "warmupcosinelr": "cosine"}
#: Each DeepSpeed scheduler's parameters (``lr_schedules.py``'s defaults beside them).
_PARAMS = {
    "constant": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000,
                 "warmup_type": "log", "last_batch_iteration": -1},
    "linear": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000,
               "warmup_type": "log", "total_num_steps": None, "last_batch_iteration": -1},
    "cosine": {"warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 0.0001,
               "warmup_type": "log", "total_num_steps": None, "last_batch_iteration": -1},
}


def from_deepspeed_scheduler(section) -> dict:
    """TrainConfig settings from DeepSpeed's ``scheduler`` section (``"auto"``: left to
    the trainer's own value, as Hugging Face's integration fills it)."""
    where = "scheduler"
    if not isinstance(section, dict) or not isinstance(section.get("type"), str):
        raise ValueError(f"{where}={section!r} must be a JSON object with a \"type\"")
    kind = _DEEPSPEED_TYPES.get(section["type"].lower())
    if kind is None:
        raise ValueError(f"{where}.type={section['type']!r}; zeroshard's trainer runs "
                         "WarmupLR, WarmupDecayLR and WarmupCosineLR")
    params = section.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"{where}.params={params!r} must be a JSON object")
    unknown = sorted(set(params) - set(_PARAMS[kind]))
    if unknown:
        known = ", ".join(repr(k) for k in _PARAMS[kind])
        raise ValueError(f"{where}.params: {', '.join(repr(k) for k in unknown)} not known "
                         f"to {section['type']}; expected some of {known}")
    p = {**_PARAMS[kind], **{k: v for k, v in params.items() if v != "auto"}}
    if p["last_batch_iteration"] != -1:
        raise ValueError(f"{where}.params.last_batch_iteration={p['last_batch_iteration']!r}: "
                         "a resumed run's step comes from its checkpoint (--resume)")
    out = {"schedule": kind, "warmup": p["warmup_num_steps"], "warmup_type": p["warmup_type"]}
    if kind == "cosine":
        out.update(warmup_start_ratio=p["warmup_min_ratio"], min_lr_ratio=p["cos_min_ratio"])
    else:  # the peak is the scheduler's (DeepSpeed's WarmupLR sets it over the optimizer's)
        peak = p["warmup_max_lr"]
        if not isinstance(peak, (int, float)) or isinstance(peak, bool) or peak <= 0:
            raise ValueError(f"{where}.params.warmup_max_lr={peak!r} must be a positive number")
        out.update(lr=peak, warmup_start_ratio=p["warmup_min_lr"] / peak, min_lr_ratio=0.0)
    if kind != "constant" and p["total_num_steps"] is not None:
        out["decay_steps"] = p["total_num_steps"]
    return out
