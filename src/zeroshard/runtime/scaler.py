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

    scaler = zs.GradScaler(model)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)          # optional: before model.clip_grad_norm_
    scaler.step(optimizer)              # skipped on every rank after an overflow
    scaler.update()
"""

from __future__ import annotations

import torch

from .nonfinite import first_bad_unit


class GradScaler:
    """Dynamic loss scaling for ``model`` (a ShardedModel), alike on every rank."""

    def __init__(self, model, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 hysteresis: int = 1, min_scale: float = 1.0, enabled: bool = True):
        for name, value, ok in (("init_scale", init_scale, init_scale > 0),
                                ("growth_factor", growth_factor, growth_factor > 1),
                                ("backoff_factor", backoff_factor, 0 < backoff_factor < 1),
                                ("growth_interval", growth_interval, growth_interval >= 1),
                                ("hysteresis", hysteresis, hysteresis >= 1),
                                ("min_scale", min_scale, min_scale > 0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok:
                raise ValueError(f"GradScaler: {name}={value!r} is out of range (init_scale, "
                                 "min_scale > 0; growth_factor > 1; 0 < backoff_factor < 1; "
                                 "growth_interval, hysteresis >= 1)")
        self.model, self.enabled = model, enabled
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis, self.min_scale = (
            growth_interval, hysteresis, min_scale)
        self._good = 0  # good steps since the last growth or overflow
        self._overflows = 0  # overflows in a row not yet acted on (hysteresis)
        self._found_inf: bool | None = None  # this cycle's verdict, once unscaled
        model.loss_scaler = self

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
        model._finalize_grads()
        grads = [s.grad for _, s in model.named_shards() if s.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self._scale)
        found = model.comm.agree(first_bad_unit(model.units))()
        self._found_inf = any(found)
        model._verdict = ("skip" if self._found_inf else "step",
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
        ``growth_interval`` good steps in a row (torch's rule, DeepSpeed's hysteresis)."""
        if not self.enabled:
            return
        if self._found_inf is None:
            raise RuntimeError("update() before step(): nothing to update from")
        if self._found_inf:
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
        self._found_inf = None

    def state_dict(self) -> dict:
        return {"scale": self._scale, "good": self._good, "overflows": self._overflows}

    def load_state_dict(self, state: dict) -> None:
        self._scale, self._good, self._overflows = (float(state["scale"]), int(state["good"]),
                                                     int(state["overflows"]))
