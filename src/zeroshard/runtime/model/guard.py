"""The module the user holds, used as a plain module: loading through it, and saving it
with Hugging Face's ``save_pretrained`` ([Note: module view] in ``unit/view.py`` for
what it shows between forwards).

Loading. torch's ``Module.load_state_dict`` copies each value into the tensor the
module registers: at stages 0-2 the full compute weights, which the next step
overwrites from the master where there is one (mixed precision); at stage 3 a DTensor of
this rank's compute rows, whose copy from a plain tensor torch refuses. Neither reaches
the master. So every module of the
tree gets a load pre-hook that writes its own parameters' values where the model holds
them (the master rows: a DTensor, the full tensor or this rank's rows, as
``model.load_state_dict`` takes them) and hands torch's copy the registered tensor
itself, a copy onto itself; the post-hook of the module the load began at then brings
the compute weights of the units it wrote up to date, once (an all-gather per unit at
stages 1-2: every rank loads, as with DDP). A value of another shape is left to torch,
which reports the size mismatch as it always does.

Saving. safetensors cannot write a DTensor: ``save_pretrained`` on a module holding
released parameters would fail deep inside ("Attempted to access the data pointer on an
invalid python storage"), after writing its config. Such a module's ``save_pretrained``
refuses up front instead, naming how to write the full weights.

Wrapping. torch DDP around the sharded model (transformers' Trainer and accelerate put
any model they are handed in it) would all-reduce the shards' gradients again, after the
engine reduced them, and train another model: :class:`RefusesDDP` stops it in one line.
"""

from __future__ import annotations

import types
import weakref

import torch
from torch.distributed.tensor import DTensor

from ..unit.dtensor import held, local_rows
from .dtensor import owners


class RefusesDDP:
    """A base of the sharded model: ``DistributedDataParallel.__init__`` reads
    ``_ddp_params_and_buffers_to_ignore`` of the module it wraps
    (``torch/nn/parallel/distributed.py``), so DDP around a sharded model stops there, at
    construction, before any step (``hasattr`` passes on any error but AttributeError)."""

    @property
    def _ddp_params_and_buffers_to_ignore(self):
        raise ValueError(
            "zeroshard: a ShardedModel cannot be wrapped in torch DistributedDataParallel "
            "(by transformers' Trainer, accelerate, Lightning's DDP or by hand): it reduces "
            "its own gradients, and DDP would reduce them again and train another model; "
            "with Hugging Face's Trainer use zeroshard.hf.Trainer(model=<the unsharded "
            "model>, zero=...), with Lightning strategy='zeroshard', in a loop of your own "
            "call the sharded model itself")


class ModuleGuard:
    """Load hooks on every module of one sharded model, and ``save_pretrained`` guards."""

    def __init__(self, model) -> None:
        self.owner = weakref.ref(model)  # the module's hooks must not keep the engine alive
        self.loading = None  # the module a load_state_dict began at
        self.written: set[int] = set()  # indices of units written since
        self.by_id: dict[int, tuple] = {}
        handles, released = [], any(u.view.sharded for u in model.units)
        for m in model.module.modules():
            handles.append(m.register_load_state_dict_pre_hook(self._before_load))
            handles.append(m.register_load_state_dict_post_hook(self._after_load))
            if released and callable(getattr(m, "save_pretrained", None)):
                m.save_pretrained = types.MethodType(_save_pretrained, m)
        self.handles = handles  # a copy of the module drops them (adapters.py)
        weakref.finalize(model, _remove, handles)

    def _before_load(self, module, state_dict, prefix, *args) -> None:
        model = self.owner()
        if model is None:
            return
        if self.loading is None:
            self.loading, self.by_id = module, owners(model)
        try:
            for name, p in module._parameters.items():
                key = prefix + name
                if p is None or key not in state_dict or id(p) not in self.by_id:
                    continue
                u, i = self.by_id[id(p)]
                try:
                    rows = local_rows(u, i, state_dict[key], f"load_state_dict: {key!r}")
                except ValueError:
                    continue  # torch's own check reports the size mismatch
                with torch.no_grad():
                    held(u, i)[0].copy_(rows)
                state_dict[key] = p  # torch's copy_ is then of p onto itself
                self.written.add(u.index)
        except BaseException:
            self.loading, self.written = None, set()
            raise

    def _after_load(self, module, incompatible_keys) -> None:
        if self.loading is not module:
            return
        written, self.loading, self.written, self.by_id = self.written, None, set(), {}
        model = self.owner()
        if model is None:
            return
        for u in model.units:
            if u.index in written:
                u.refresh_compute()
        model.synchronize()


def _save_pretrained(module, *args, **kwargs):
    """``save_pretrained`` of a module whose released parameters are DTensors."""
    given = kwargs.get("state_dict", args[2] if len(args) > 2 else None)
    released = [n for n, p in module.named_parameters() if isinstance(p, DTensor)]
    if given is None and released:
        raise ValueError(
            f"{type(module).__name__}.save_pretrained(): at ZeRO stage 3 this module holds "
            f"each rank's rows of {len(released)} parameters (DTensors, e.g. "
            f"{released[0]!r}), and safetensors writes only whole tensors. Write the full "
            "weights: on every rank full = model.full_state_dict() (a collective; keys of "
            "model.module), then module.save_pretrained(path, state_dict=full, "
            "is_main_process=rank == 0) — or zs.save() and `zeroshard export`")
    return type(module).save_pretrained(module, *args, **kwargs)


def _remove(handles: list) -> None:
    for h in handles:
        h.remove()
