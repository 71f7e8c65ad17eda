"""Profiling mode: every unit's lifecycle as a timeline, with the bytes held per category
at each event, and every collective with its issue time, completion and wait.

The source document's exercise (``seeds/002``): draw each unit's parameter and gradient
lifetimes through forward and backward, find the measured peak and what coexists at it.
It subscribes to the engine's lifecycle events (``runtime/events.py``). Bytes are read
off the tensors the engine holds (``ShardedModel.memory``) and, for
activations, counted by saved-tensor hooks: a tensor autograd saves for backward is
counted from the moment it is saved until backward unpacks it (parameters, which
autograd saves too, are not activations). On CUDA ``torch.cuda.memory_allocated`` is
recorded beside them.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from ..runtime.events import KINDS
from ..runtime.unit import UnitState, local

__all__ = ["KINDS", "Event", "Profiler"]


@dataclass
class Event:
    t: float
    """Seconds since the profiler started."""
    kind: str
    unit: int | None
    memory: dict[str, int]
    """Bytes per category at this moment, ``activations`` included."""
    gathered: dict[int, str] = field(default_factory=dict)
    """Units whose full parameters are alive or arriving: index -> "current",
    "prefetched" (gathered ahead of use) or "arriving" (its gather is in flight)."""


class Profiler:
    """Collects events and collective records for one sharded model on this rank: a
    listener of ``model.events``."""

    def __init__(self, model):
        self.model = model
        self.t0 = time.perf_counter()
        self.events: list[Event] = []
        self.collectives: list[dict] = []
        self.optimizer = None
        self._enabled = False
        self.enabled = True
        self.activation_bytes = 0
        self._saved: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        model.events.subscribe(self)

    @property
    def enabled(self) -> bool:
        """False pauses recording, collectives included (profile a window of steps)."""
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = value
        self.model.comm.trace = self.collectives if value else None

    def event(self, kind: str, unit=None, optimizer=None) -> None:
        if optimizer is not None:
            self.optimizer = optimizer
        if not self.enabled:
            return
        mem = self.model.memory(self.optimizer)
        mem["activations"] = self.activation_bytes
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            mem["cuda_allocated"] = torch.cuda.memory_allocated()
        gathered = {u.index: "prefetched" if u.prefetched else
                    ("current" if u.state is UnitState.GATHERED else "arriving")
                    for u in self.model.units
                    if u.policy.shards_params and u.state is not UnitState.SHARDED}
        self.events.append(Event(time.perf_counter() - self.t0, kind,
                                 None if unit is None else unit.index, mem, gathered))

    # -- activations: saved-tensor hooks ------------------------------------------------
    def _param_storages(self) -> set[int]:
        # the full parameters (not what the module shows: a released unit shows DTensors);
        # a tensor-parallel one's values are its local tensor's
        return {local(p).untyped_storage().data_ptr() for u in self.model.units
                for p in u.params}

    def pack(self, t: torch.Tensor):
        storage = local(t).untyped_storage()  # (autograd saves DTensors beside TP)
        key = storage.data_ptr()
        if key and key not in self._param_storages():
            entry = self._saved.setdefault(key, [0, storage.nbytes()])
            if entry[0] == 0:
                self.activation_bytes += entry[1]
            entry[0] += 1
            return (t, key)
        return (t, None)

    def unpack(self, packed):
        t, key = packed
        entry = self._saved.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                self.activation_bytes -= entry[1]
                del self._saved[key]
        return t

    def saved_tensors(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def forward_context(self):
        """The model's forward runs inside this: activations are counted while enabled."""
        return self.saved_tensors() if self.enabled else contextlib.nullcontext()

    # -- reading the record ---------------------------------------------------------------
    def total(self, e: Event) -> int:
        m = e.memory
        return sum(m[k] for k in ("params", "grads", "optimizer", "padding", "gathered",
                                  "buffers", "activations"))

    def peak(self) -> tuple[int, Event]:
        k = max(range(len(self.events)), key=lambda i: self.total(self.events[i]))
        return k, self.events[k]

    def phase_at(self, k: int) -> str:
        """"unit 3 backward" for the latest begin event at or before event k."""
        for e in reversed(self.events[:k + 1]):
            if e.kind in ("forward_begin", "backward_begin"):
                return f"unit {e.unit} {e.kind.split('_')[0]}"
            if e.kind == "step_begin":
                return "the optimizer step"
        return "set-up"

    def peak_statement(self) -> str:
        """One line: the peak and what coexists at it."""
        k, e = self.peak()
        m, mb = e.memory, 1e6
        persistent = m["params"] + m["grads"] + m["optimizer"]
        units = ", ".join(f"unit {i} {s}" for i, s in sorted(e.gathered.items()))
        return (f"peak {self.total(e) / mb:.3f} MB at {self.phase_at(k)}: persistent "
                f"{persistent / mb:.3f} = params {m['params'] / mb:.3f} + grads "
                f"{m['grads'] / mb:.3f} + optimizer {m['optimizer'] / mb:.3f}; gathered "
                f"{m['gathered'] / mb:.3f}" + (f" ({units})" if units else "") +
                f"; activations {m['activations'] / mb:.3f}; buffers {m['buffers'] / mb:.3f}"
                f"; padding {m['padding'] / mb:.3f}")
