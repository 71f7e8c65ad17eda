"""Lifecycle events: the engine tells, whoever listens records.

The engine emits one event per step of a unit's lifecycle to an :class:`Events` hub
that does nothing until something subscribes (the profiler in ``zeroshard.observe``
does). So ``runtime/`` never imports the code that watches it, and an engine without
listeners pays one empty loop per event.
"""

from __future__ import annotations

import contextlib

#: Lifecycle events, in the order a stage-3 unit goes through them.
KINDS = ("forward_begin", "gather_issued", "gather_done", "forward_end", "release",
         "backward_begin", "backward_end", "reduce_issued", "reduce_done", "step_begin",
         "step_end")


class Events:
    """Subscribers of one sharded model's lifecycle events.

    A listener has ``event(kind, unit, **info)`` (``unit`` is a
    :class:`~zeroshard.runtime.unit.Unit` or None; ``step_begin`` carries
    ``optimizer=``) and may have ``forward_context()``, a context manager the model's
    forward runs inside (the profiler's saved-tensor hooks)."""

    def __init__(self) -> None:
        self.listeners: list = []

    def subscribe(self, listener) -> None:
        self.listeners.append(listener)

    def unsubscribe(self, listener) -> None:
        self.listeners.remove(listener)

    def emit(self, kind: str, unit=None, **info) -> None:
        for listener in self.listeners:
            listener.event(kind, unit, **info)

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Every listener's forward context, entered in subscription order."""
        stack = contextlib.ExitStack()
        for listener in self.listeners:
            enter = getattr(listener, "forward_context", None)
            if enter is not None:
                stack.enter_context(enter())
        return stack
