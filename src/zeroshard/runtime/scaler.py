"""Dynamic loss scaling for fp16 on a sharded model: ``torch.amp.GradScaler``'s interface
and rules, with the overflow check agreed across ranks.

fp16 has 5 exponent bits: gradients below 2^-24 underflow to zero, so the loss is
multiplied by a large scale S before backward and the gradients divided by S before
the step (Micikevicius et al., "Mixed Precision Training"). Too large an S overflows to
inf: that step is skipped and S shrinks; after ``growth_interval`` good steps in a row
S grows. Each rank sees only its 1/N of the reduced gradients, so the verdict is one
exchange of a flag per rank (``nonfinite.py``), and every rank skips the same steps and
keeps the same S. ``hysteresis`` (DeepSpeed's) lets that many overflows in a row pass
before S shrinks; 1 is torch's rule.

``GradScaler.from_deepspeed(model, config)`` reads DeepSpeed's ``fp16`` block and follows
DeepSpeed's own rule (``DynamicLossScaler.update_scale``) to the step, so a run moved
from DeepSpeed skips the same steps at the same scales: ``loss_scale`` > 0 is a static
scale (overflowing steps are still skipped), 0 dynamic from ``2**initial_scale_power``;
the scale grows when the steps since the last overflow, less one, are a positive
multiple of ``loss_scale_window``; the hysteresis budget refills on every good step
(``consecutive_hysteresis``) or only when the scale grows, and is not refilled by a
shrink, so once spent every further overflow in a row halves the scale.

    scaler = zs.GradScaler(model)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)          # optional: before model.clip_grad_norm_
    scaler.step(optimizer)              # skipped on every rank after an overflow
    scaler.update()
"""

from __future__ import annotations

import math
import warnings

import torch

from .._jsonfile import read_json_object
from ..spec.deepspeed import DEEPSPEED_FP16
from .stepping import first_bad_unit


class GradScaler:
    """Dynamic loss scaling for ``model`` (a ShardedModel), alike on every rank."""

    def __init__(self, model, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 hysteresis: int = 1, min_scale: float = 1.0, enabled: bool = True,
                 dynamic: bool = True):
        def finite_above(low):
            return lambda v: low < v < math.inf

        def count(v):
            return isinstance(v, int) and v >= 1

        for name, value, ok in (("init_scale", init_scale, finite_above(0)),
                                ("growth_factor", growth_factor, finite_above(1)),
                                ("backoff_factor", backoff_factor, lambda v: 0 < v < 1),
                                ("growth_interval", growth_interval, count),
                                ("hysteresis", hysteresis, count),
                                ("min_scale", min_scale, finite_above(0))):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"GradScaler: {name}={value!r} is out of range (init_scale, "
                                 "min_scale finite and > 0; growth_factor finite and > 1; "
                                 "0 < backoff_factor < 1; growth_interval, hysteresis "
                                 "integers >= 1)")
        self.model, self.enabled, self.dynamic = model, enabled, dynamic
        self._deepspeed: dict | None = None  # DeepSpeed's rule: its counters, else None
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis, self.min_scale = (
            growth_interval, hysteresis, min_scale)
        self._good = 0  # good steps since the last growth or overflow
        self._overflows = 0  # overflows in a row not yet acted on (hysteresis)
        self._found_inf: bool | None = None  # this cycle's verdict, once unscaled
        model.stepper.attach_scaler(self)

    def get_scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale (unchanged when disabled)."""
        return loss * self._scale if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, optimizer) -> None:
        """Make the gradients final, divide them by the scale, and agree across ranks
        whether any is non-finite (one small exchange). Once per step."""
        if not self.enabled:
            return
        if self._found_inf is not None:
            raise RuntimeError("unscale_() has already been called since the last update()")
        model = self.model
        model.stepper.finalize_grads()
        grads = [s.grad for _, s in model.named_shards() if s.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self._scale)
        found = model.comm.agree(first_bad_unit(model.units))()
        self._found_inf = any(found)
        model.stepper.set_verdict(self._found_inf,
                                  f"fp16 overflow at loss scale {self._scale:g}")

    def step(self, optimizer, *args, **kwargs):
        """``optimizer.step()``, which the engine turns into a skip on every rank after
        an overflow (no parameter gets a gradient); returns its result, None if skipped."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        if self._found_inf is None:
            self.unscale_(optimizer)
        result = optimizer.step(*args, **kwargs)
        return None if self._found_inf else result

    def update(self) -> None:
        """Shrink the scale after ``hysteresis`` overflows in a row; grow it after
        ``growth_interval`` good steps in a row (torch's rule, DeepSpeed's hysteresis;
        DeepSpeed's own rule after :meth:`from_deepspeed`; a static scale stays)."""
        if not self.enabled:
            return
        if self._found_inf is None:
            raise RuntimeError("update() before step(): nothing to update from")
        found_inf, self._found_inf = self._found_inf, None
        if not self.dynamic:
            return
        if self._deepspeed is not None:
            self._update_deepspeed(found_inf)
        elif found_inf:
            self._good = 0
            self._overflows += 1
            if self._overflows >= self.hysteresis:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
                self._overflows = 0
        else:
            self._overflows = 0
            self._good += 1
            if self._good == self.growth_interval:
                self._scale *= self.growth_factor
                self._good = 0

    def _update_deepspeed(self, overflow: bool) -> None:
        """DeepSpeed's ``DynamicLossScaler.update_scale``, step for step."""
        ds = self._deepspeed
        if overflow:
            if self.hysteresis == 1 or ds["left"] == 1:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            else:
                ds["left"] -= 1
            ds["last_overflow"] = ds["iter"]
        else:
            if ds["consecutive"]:
                ds["left"] = self.hysteresis
            stable = ds["iter"] - ds["last_overflow"] - 1
            if stable > 0 and stable % self.growth_interval == 0:
                if not ds["consecutive"]:
                    ds["left"] = self.hysteresis
                self._scale *= self.growth_factor
        ds["iter"] += 1

    @staticmethod
    def deepspeed_settings(config) -> dict:
        """The loss-scaling settings of a DeepSpeed config (a dict or a JSON file path)
        whose ``fp16`` block is enabled: each of DeepSpeed's keys, its default where
        absent; a bad value is an error naming its key."""
        if not isinstance(config, dict):
            config = read_json_object(config, "config")
        block = config.get("fp16", {})
        if not isinstance(block, dict) or block.get("enabled") is not True:
            raise ValueError(f"fp16={block!r}: GradScaler.from_deepspeed needs a DeepSpeed "
                             "config whose fp16 block has \"enabled\": true")
        got = {k: block.get(k, default) for k, default in DEEPSPEED_FP16.items()}
        for key, value in got.items():
            kind = bool if key == "consecutive_hysteresis" else (int, float)
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise ValueError(f"fp16.{key}={value!r} must be "
                                 f"{'true or false' if kind is bool else 'a number'}")
        for key, ok, accepted in (
                ("loss_scale", got["loss_scale"] >= 0, "0 (dynamic) or a positive static scale"),
                ("loss_scale_window", got["loss_scale_window"] >= 1, "at least 1"),
                ("hysteresis", got["hysteresis"] >= 1, "at least 1"),
                ("min_loss_scale", got["min_loss_scale"] > 0, "above 0")):
            if not ok:
                raise ValueError(f"fp16.{key}={got[key]!r}; expected {accepted}")
        return got

    @classmethod
    def from_deepspeed(cls, model, config) -> GradScaler:
        """A scaler from a DeepSpeed config (a dict or a JSON file path) whose ``fp16``
        block is enabled, with DeepSpeed's defaults for absent keys and its update rule."""
        if not isinstance(config, dict):
            config = read_json_object(config, "config")
        got = cls.deepspeed_settings(config)
        unknown = sorted(set(config["fp16"]) - set(DEEPSPEED_FP16) - {"enabled"})
        if unknown:
            warnings.warn(f"DeepSpeed fp16 keys ignored by zeroshard: {', '.join(unknown)}",
                          stacklevel=2)
        static = got["loss_scale"] > 0
        scaler = cls(model, init_scale=(got["loss_scale"] if static
                                        else 2.0 ** got["initial_scale_power"]),
                     growth_interval=got["loss_scale_window"], hysteresis=got["hysteresis"],
                     min_scale=got["min_loss_scale"], dynamic=not static)
        scaler._deepspeed = {"iter": 0, "last_overflow": -1, "left": got["hysteresis"],
                             "consecutive": got["consecutive_hysteresis"]}
        return scaler

    def state_dict(self) -> dict:
        state = {"scale": self._scale, "good": self._good, "overflows": self._overflows}
        if self._deepspeed is not None:
            state["deepspeed"] = dict(self._deepspeed)
        return state

    def load_state_dict(self, state: dict) -> None:
        self._scale, self._good, self._overflows = (float(state["scale"]), int(state["good"]),
                                                     int(state["overflows"]))
        if self._deepspeed is not None and "deepspeed" in state:
            self._deepspeed = dict(state["deepspeed"])
