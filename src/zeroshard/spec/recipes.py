"""Precision recipes: the bytes each parameter costs, per category.

A recipe names the dtype of every copy of the training state. The planner turns it
into bytes per parameter; the engine allocates its tensors from the very same fields
(``zeroshard.runtime`` maps the dtype names to ``torch.dtype``), so the plan and the
ledger cannot disagree about what a category costs.

Categories (ZeRO paper, section 3; 16 bytes per parameter for mixed-precision Adam):

- **weights**: the compute copy of the parameters (``param_dtype``).
- **grads**: the stored gradients (``grad_dtype``).
- **optimizer**: the master copy (``master_dtype``, absent when the compute copy is
  already the master) plus ``optimizer_states`` per-element states (``state_dtype``),
  e.g. Adam's m and v. ``optimizer`` names the optimizer (``spec/optimizers.py``):
  where its state is not a fixed count per element (Muon's one moment for the
  matrices and AdamW's two for the rest; Adafactor's row and column statistics), the
  planner counts it from the parameters' shapes, and ``optimizer_states`` is the
  nominal count of a model made of matrices (Muon 1, Adafactor 0).

This module imports nothing but the standard library.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .optimizers import OPTIMIZERS, get_optimizer

#: Bytes per element of each dtype name a recipe may use.
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Recipe:
    """Dtypes of the copies of the training state; validated at construction."""

    name: str
    """Name shown in tables and accepted by ``--precision``."""
    param_dtype: str
    """Dtype of the compute weights that forward and backward run in."""
    grad_dtype: str
    """Dtype in which gradients are stored and accumulated."""
    master_dtype: str | None
    """Dtype of the master weights the optimizer updates; None when the compute
    weights are the master (pure fp32 training keeps no second copy)."""
    state_dtype: str = "fp32"
    """Dtype of each per-element optimizer state (Adam's m and v)."""
    optimizer_states: int = 2
    """Per-element optimizer states: 2 for Adam/AdamW, 1 for SGD with momentum."""
    reduce_dtype: str | None = None
    """Dtype gradients travel in during reduction; None means ``grad_dtype``."""
    optimizer: str = "adamw"
    """The optimizer the state is for, a name of ``spec.optimizers.OPTIMIZERS``."""
    custom_bytes: tuple[int, int, int] | None = None
    """Explicit (weights, grads, optimizer) bytes per parameter, for planning a recipe
    that the dtypes above cannot describe. The engine refuses such a recipe."""

    def __post_init__(self) -> None:
        for field in ("param_dtype", "grad_dtype", "master_dtype", "state_dtype", "reduce_dtype"):
            value = getattr(self, field)
            if value is not None and value not in DTYPE_BYTES:
                raise ValueError(
                    f"recipe {self.name!r}: {field}={value!r} is not a known dtype; "
                    f"expected one of {sorted(DTYPE_BYTES)}"
                )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"recipe {self.name!r}: optimizer={self.optimizer!r}; expected "
                             f"one of {', '.join(OPTIMIZERS)}")
        if self.optimizer_states < 0:
            raise ValueError(
                f"recipe {self.name!r}: optimizer_states={self.optimizer_states} must be >= 0"
            )
        if self.custom_bytes is not None:
            if len(self.custom_bytes) != 3 or any(
                not isinstance(b, int) or b < 0 for b in self.custom_bytes
            ):
                raise ValueError(
                    f"recipe {self.name!r}: custom_bytes={self.custom_bytes!r} must be three "
                    "non-negative integers (weights, grads, optimizer)"
                )

    @property
    def weight_bytes(self) -> int:
        """Bytes per parameter of the compute weights."""
        if self.custom_bytes:
            return self.custom_bytes[0]
        return DTYPE_BYTES[self.param_dtype]

    @property
    def grad_bytes(self) -> int:
        """Bytes per parameter of the stored gradients."""
        if self.custom_bytes:
            return self.custom_bytes[1]
        return DTYPE_BYTES[self.grad_dtype]

    @property
    def master_bytes(self) -> int:
        """Bytes per parameter of the master copy (0 without one)."""
        if self.custom_bytes or self.master_dtype is None:
            return 0
        return DTYPE_BYTES[self.master_dtype]

    @property
    def optimizer_bytes(self) -> int:
        """Bytes per parameter of the optimizer category: master copy plus states."""
        if self.custom_bytes:
            return self.custom_bytes[2]
        return self.master_bytes + self.optimizer_states * DTYPE_BYTES[self.state_dtype]

    @property
    def reduce_bytes(self) -> int:
        """Bytes per gradient element on the wire during reduction."""
        if self.custom_bytes:
            return self.custom_bytes[1]
        return DTYPE_BYTES[self.reduce_dtype or self.grad_dtype]

    @property
    def activation_bytes(self) -> int:
        """Bytes per activation element: activations live in the compute dtype."""
        return self.weight_bytes

    @property
    def total_bytes(self) -> int:
        """Persistent bytes per parameter when nothing is sharded (16 for mixed AdamW)."""
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes

    def with_reduce_dtype(self, reduce_dtype: str | None) -> Recipe:
        """The same recipe with gradients reduced in another dtype."""
        return dataclasses.replace(self, reduce_dtype=reduce_dtype)

    def with_optimizer(self, optimizer: str) -> Recipe:
        """The same dtypes with the state of another optimizer (``zeroshard plan
        --optimizer``): ``bf16-mixed-adamw`` becomes ``bf16-mixed-muon``."""
        spec = get_optimizer(optimizer)
        if optimizer == self.optimizer:
            return self
        name = (self.name.replace(self.optimizer, optimizer) if self.optimizer in self.name
                else f"{self.name}-{optimizer}")
        return dataclasses.replace(self, name=name, optimizer=optimizer,
                                   optimizer_states=spec.states)

    @property
    def shaped_state(self) -> bool:
        """The optimizer's state is counted from the parameters' shapes, not per element
        (Muon with AdamW for the rest, Adafactor)."""
        spec = OPTIMIZERS[self.optimizer]
        return spec.factored or spec.matrices_only


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        # 2 + 2 + (4 master + 4 m + 4 v) = 16: the ZeRO paper's mixed-precision Adam.
        Recipe("bf16-mixed-adamw", "bf16", "bf16", "fp32"),
        Recipe("fp16-mixed-adamw", "fp16", "fp16", "fp32"),
        # Gradients accumulated in fp32 beside bf16 compute: 2 + 4 + 12 = 18.
        Recipe("bf16-mixed-adamw-fp32-grads", "bf16", "fp32", "fp32"),
        # No master copy: the fp32 weights are what the optimizer updates. 4 + 4 + 8 = 16.
        Recipe("fp32-adamw", "fp32", "fp32", None),
        Recipe("fp32-sgd-momentum", "fp32", "fp32", None, optimizer_states=1,
               optimizer="sgd"),
    )
}

DEFAULT_RECIPE = "bf16-mixed-adamw"


def get_recipe(spec: str | Recipe) -> Recipe:
    """A recipe by name, or a custom one written ``W/G/O`` (bytes per parameter).

    >>> get_recipe("2/2/12").total_bytes
    16
    """
    if isinstance(spec, Recipe):
        return spec
    if spec in RECIPES:
        return RECIPES[spec]
    parts = spec.split("/")
    if len(parts) == 3 and all(p.strip().isdigit() for p in parts):
        w, g, o = (int(p) for p in parts)
        return Recipe(f"custom-{w}/{g}/{o}", "fp32", "fp32", None, custom_bytes=(w, g, o))
    raise ValueError(
        f"unknown precision recipe {spec!r}; expected one of {', '.join(RECIPES)} "
        "or custom bytes per parameter as W/G/O (e.g. 2/2/12)"
    )
