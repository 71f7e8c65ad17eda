"""Activation checkpointing at the unit's boundary (``ZeroConfig.activation_checkpointing``).

[Note: activation checkpointing] ZeRO shards the training state, not the activations:
each rank keeps every tensor its micro-batch's forward saves for backward. Checkpointing
keeps less and recomputes the rest in backward (Chen et al., 2016), and the unit is its
natural boundary: at stage 3 a unit is gathered again for its backward anyway, so the
recompute runs on weights that are there. Each unit but the root (the embeddings, the
final norm and head: the loss's backward needs them first) gets its module's
``forward`` replaced by torch's non-reentrant ``torch.utils.checkpoint`` of it — as
torchtitan wraps each block before ``fully_shard`` — so the engine's hooks stay around
the module's call, outside the checkpoint:

- "full": the unit keeps its inputs; its forward runs again in backward, when autograd
  first asks for one of its saved tensors (after the unit's pre-backward gather).
- "selective": the outputs of its matrix multiplications (``aten.mm`` and ``addmm``: the
  linear layers) are kept as well, and only the rest is recomputed: elementwise
  operations, norms, and attention's core (its softmax and batched products), which
  Korthikanti et al. (2022, section 5) found holds most of the bytes at little of the
  compute (torch's ``create_selective_checkpoint_contexts``).
- every k-th unit "full", the others keeping everything (torchtitan's per-layer
  checkpointing).
- "full+offload": as "full", but what the checkpoint keeps of the unit's positional
  inputs is a copy in pinned host memory, made on a side stream that overlaps the next
  unit's forward, and brought back for the recompute; the device's inputs are let go
  after the forward. On the CPU the host is where the inputs are: they are kept as
  "full" keeps them.

The maths is the same: a recompute runs the same operations on the same inputs (the
RNG state restored for dropout), so the gradients are bit for bit those of the run that
kept everything. A model that checkpoints itself (transformers'
``gradient_checkpointing_enable``, the built-in GPT's ``checkpointing``) is left as it
is: wrapped twice, it would recompute twice. In training, a checkpointed unit is called
without a key-value cache: a recompute would append its keys and values to the cache a
second time (transformers turns the cache off under its own checkpointing alike).

What is held is told to whoever listens (the profiler, which counts saved tensors with
saved-tensor hooks that a checkpoint hides from it): a unit's kept inputs (and selective
checkpointing's kept outputs) from its forward until the last of its saved tensors is
used in backward, and each recomputed tensor from its recompute until backward uses it;
``recompute_end`` marks the moment all of a unit's are back, its peak.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

#: The operations selective checkpointing keeps the outputs of: the linear layers'.
KEPT_OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)

#: Cache keyword arguments a checkpointed call in training goes without (besides any
#: argument holding a transformers ``Cache``, whatever its name: ``cache`` in recent ones).
_CACHE_KWARGS = {"past_key_values": None, "past_key_value": None, "layer_past": None,
                 "use_cache": False}


def apply(model) -> int:
    """Wrap the forward of the units ``model.zero_config.activation_checkpointing``
    names; return how many units were wrapped."""
    mode = model.zero_config.activation_checkpointing
    if mode == "none":
        return 0
    if checkpoints_itself(model.module):
        warnings.warn(f"activation_checkpointing={mode!r}: {type(model.module).__name__} "
                      "checkpoints itself (gradient_checkpointing_enable), which is kept; "
                      "zeroshard does not wrap it twice", stacklevel=3)
        return 0
    every = mode if isinstance(mode, int) else 1
    blocks = [u for u in model.units if u.module is not model.module]
    if len(blocks) < every:
        warnings.warn(f"activation_checkpointing={mode!r}: the model has {len(blocks)} "
                      "unit(s) besides the root, so no unit is checkpointed; shard it in "
                      "blocks (units='blocks', the default) to checkpoint them", stacklevel=3)
    wrapped = 0
    for j, unit in enumerate(blocks):
        if (j + 1) % every == 0:
            m = unit.module
            m.forward = _Checkpointed(m.forward, mode, model.events, unit)
            wrapped += 1
    return wrapped


def checkpoints_itself(module: torch.nn.Module) -> bool:
    """Whether ``module`` recomputes its own activations already: transformers' models
    after ``gradient_checkpointing_enable`` (peft's through their base), the built-in
    GPT built with ``checkpointing``."""
    base = getattr(module, "get_base_model", None)
    if callable(base):  # peft's model: its base says
        module = base()
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # 5.x, 4.x
        if hasattr(type(module), name):
            return getattr(module, name) is True
    return getattr(getattr(module, "config", None), "checkpointing", False) is True


def is_checkpointed(forward) -> bool:
    """Whether ``forward`` is a unit's forward this module wrapped."""
    return isinstance(forward, _Checkpointed)


def _keep_linear(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> tuple:
    """Selective checkpointing's context pair for ``torch.utils.checkpoint`` (its
    ``context_fn``): the outputs of :data:`KEPT_OPS` kept, the rest recomputed."""
    return create_selective_checkpoint_contexts(_keep_linear)


class _Checkpointed:
    """A unit module's forward, checkpointed in training (grad enabled, not inside a
    backward's recompute); plain in inference."""

    def __init__(self, forward, mode, events, unit):
        functools.update_wrapper(self, forward)
        self.forward, self.mode, self.events, self.unit = forward, mode, events, unit
        self.context = selective_context if mode == "selective" else noop_context_fn

    def compile(self, *args, **kwargs) -> None:
        """``torch.compile`` the unit's own forward, which the checkpoint then calls (and
        calls again to recompute: ``ShardedModel.compile``)."""
        self.forward = torch.compile(self.forward, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return self.forward(*args, **kwargs)
        args = tuple(_without_cache("", a) for a in args)  # GPT-2 passes its cache by place
        kwargs = {k: _without_cache(k, v) for k, v in kwargs.items()}
        if self.mode == "full+offload":
            fn, held, args = _Offloaded(self.forward, args), list(kwargs.values()), ()
            if fn.on_host is None:  # on the CPU the host is where the inputs are
                held += list(fn.args)
        else:
            fn, held = self.forward, [args, kwargs]
        if self.events.listeners:  # a profiler counts what the checkpoint holds
            fn = _Counted(fn, self.events, self.unit, self.mode == "selective")
            fn.hold([t for t in tree_flatten(held)[0] if torch.is_tensor(t)])
        return checkpoint(fn, *args, use_reentrant=False, context_fn=self.context, **kwargs)


def _without_cache(name: str, value):
    """A keyword argument's value for a checkpointed call in training: no key-value cache
    (one is recognised by its ``get_seq_length``, transformers' ``Cache`` API)."""
    if name in _CACHE_KWARGS:
        return _CACHE_KWARGS[name]
    return None if hasattr(value, "get_seq_length") else value


#: One side stream per device for offload's copies to the host.
_COPY_STREAMS: dict = {}


class _Offloaded:
    """A unit's forward whose positional inputs the checkpoint does not keep: the first
    call (the forward) takes them as given, the graph's own; a copy in pinned host memory
    is what is kept, brought back to the device for the recompute (detached, as
    requiring grad as before: the recompute saves the same tensors, and gradients flow
    through the forward's graph, not through the copies). On a GPU the copy to the host
    runs on a side stream, overlapping the next unit's forward; ``on_host`` is None on the
    CPU, where the inputs already are in host memory and are kept as they are."""

    def __init__(self, forward, args: tuple):
        self.forward, self.args = forward, args
        device = next((t.device for t in args if torch.is_tensor(t)), None)
        self.on_host = None
        if device is not None and device.type == "cuda":
            stream = _COPY_STREAMS.setdefault(device, torch.cuda.Stream(device))
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self.on_host = [_to_host(t, stream) for t in args]
            self.stream = stream
        self.first = True

    def __call__(self, **kwargs):
        if self.first:  # the forward: the inputs as the graph has them
            self.first = False
            args = self.args
            if self.on_host is not None:
                self.args = ()  # let go of the device's copies
            return self.forward(*args, **kwargs)
        if self.on_host is None:
            args = tuple(_detached(t) for t in self.args)
        else:
            torch.cuda.current_stream().wait_stream(self.stream)
            args = tuple(_back(h) for h in self.on_host)
        return self.forward(*args, **kwargs)


class _Host:
    """A pinned host copy of a device tensor, where it came from, and whether it
    required grad."""

    def __init__(self, t: torch.Tensor, stream):
        self.out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.out.copy_(t.detach(), non_blocking=True)
        t.record_stream(stream)  # its memory is not reused before the copy is done
        self.device, self.grad = t.device, t.requires_grad


def _to_host(t, stream):
    return _Host(t, stream) if torch.is_tensor(t) else t


def _back(held):
    if not isinstance(held, _Host):
        return held
    return held.out.to(held.device, non_blocking=True).requires_grad_(held.grad)


def _detached(t):
    return t.detach().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t


class _Counted:
    """One checkpointed call of a unit's forward, telling the listeners what it holds:
    wrapped around the hooks the checkpoint puts on top (``_checkpoint_hook`` in
    forward, ``_recomputation_hook`` in the recompute; ``torch/utils/checkpoint.py``),
    which it calls through."""

    def __init__(self, forward, events, unit, selective: bool):
        self.forward, self.events, self.unit, self.selective = forward, events, unit, selective
        self.kept: list = []  # the listeners' tokens of the inputs (and kept outputs)
        self.saved = 0  # tensors the forward saved (the checkpoint's holders)
        self.used = 0  # of them, unpacked by backward
        self.recomputed: dict[int, list] = {}  # holder index -> the listeners' tokens
        self.next = 0  # the next holder the recompute fills

    def hold(self, tensors: list) -> None:
        for t in tensors:
            self.kept.extend(self._held(t))

    def _held(self, t: torch.Tensor) -> list:
        return [(listener, listener.pack(t)) for listener in self.events.listeners
                if hasattr(listener, "pack")]

    @staticmethod
    def _let_go(tokens: list) -> None:
        for listener, token in tokens:
            listener.unpack(token)

    def __call__(self, *args, **kwargs):
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:
            return self.forward(*args, **kwargs)
        inner_pack, inner_unpack = top
        if torch._C._current_graph_task_id() == -1:  # the forward: count the holders
            hooks = (functools.partial(self._forward_pack, inner_pack),
                     functools.partial(self._forward_unpack, inner_unpack))
            mode = _KeptOutputs(self) if self.selective else None
        else:  # the recompute: each tensor held from now until backward uses it
            hooks = (functools.partial(self._recompute_pack, inner_pack), inner_unpack)
            mode = None
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            if mode is None:
                return self.forward(*args, **kwargs)
            with mode:
                return self.forward(*args, **kwargs)

    def _forward_pack(self, inner_pack, x):
        self.saved += 1
        return (self.saved - 1, inner_pack(x))

    def _forward_unpack(self, inner_unpack, packed):
        k, holder = packed
        out = inner_unpack(holder)  # recomputes the whole unit on the first call
        self._let_go(self.recomputed.pop(k, []))
        self.used += 1
        if self.used == self.saved:  # the unit's backward has used every one
            self._let_go(self.kept)
            self.kept = []
        return out

    def _recompute_pack(self, inner_pack, x):
        k = self.next
        self.next += 1
        self.recomputed[k] = self._held(x)
        if self.next == self.saved:  # every saved tensor is back: the recompute's peak
            self.events.emit("recompute_end", self.unit)
        return inner_pack(x)  # (raises to stop the recompute early after the last)


class _KeptOutputs(TorchDispatchMode):
    """Selective checkpointing's forward: the outputs it keeps (``KEPT_OPS``), told as
    held beside the inputs."""

    def __init__(self, counted: _Counted):
        super().__init__()
        self.counted = counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in KEPT_OPS:
            tree_map(lambda t: self.counted.hold([t]) if torch.is_tensor(t) else None, out)
        return out
