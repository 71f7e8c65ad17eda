"""The module inside a sharded model, used as the plain module it was: loading and
saving through it, and peft's calls on it.
"""

from __future__ import annotations

import copy
import functools
import sys
import types
import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .dtensor import owners
from .unit import held, local_rows

# ----------------------------------------------------------------------------------------
# The module the user holds, used as a plain module: loading through it, and saving it
# with Hugging Face's ``save_pretrained`` ([Note: module view] in ``unit.py`` for
# what it shows between forwards).
#
# Loading. torch's ``Module.load_state_dict`` copies each value into the tensor the
# module registers: at stages 0-2 the full compute weights, which the next step
# overwrites from the master where there is one (mixed precision); at stage 3 a DTensor of
# this rank's compute rows, whose copy from a plain tensor torch refuses. Neither reaches
# the master. So every module of the
# tree gets a load pre-hook that writes its own parameters' values where the model holds
# them (the master rows: a DTensor, the full tensor or this rank's rows, as
# ``model.load_state_dict`` takes them) and hands torch's copy the registered tensor
# itself, a copy onto itself; the post-hook of the module the load began at then brings
# the compute weights of the units it wrote up to date, once (an all-gather per unit at
# stages 1-2: every rank loads, as with DDP). A value of another shape is left to torch,
# which reports the size mismatch as it always does.
#
# Saving. safetensors cannot write a DTensor: ``save_pretrained`` on a module holding
# released parameters would fail deep inside ("Attempted to access the data pointer on an
# invalid python storage"), after writing its config. Such a module's ``save_pretrained``
# refuses up front instead, naming how to write the full weights.
# ----------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------
# peft's calls on a sharded model: what works, what is refused, and why.
#
# A LoRA model (``peft.get_peft_model``) is sharded like any other: its frozen base and
# its adapters sit in the same units, the base sharded at stage 3 and the adapters
# trained (``unit.py``). peft's own methods then meet a module whose weights are
# this rank's rows (stage 3), or the compute copies of a master kept elsewhere (mixed
# precision), so each call that reads or changes weights is answered here, on the
# instance (as the guard answers ``save_pretrained``, ``guard.py``):
#
# - ``save_pretrained(dir)`` writes the adapter only, in peft's files, with the values
#   the optimizer holds: every rank calls it (a collective where the adapter is sharded)
#   and rank 0 writes (``is_main_process``, as peft takes it). peft picks the tensors
#   (``get_peft_model_state_dict`` in ``peft/utils/save_and_load.py``, asked over
#   placeholders so nothing is gathered twice); only those are gathered. A
#   ``state_dict=`` given is written as it is.
# - ``merge_and_unload()`` and ``unload()`` return a new, whole, unsharded model on every
#   rank (a collective): the full weights go into a copy of the module, which peft then
#   merges (``BaseTuner._unload_and_optionally_merge``); the sharded model is left as it
#   was and trains on.
# - ``add_adapter``, ``load_adapter``, ``delete_adapter``: refused, since the engine took
#   the parameters once, at ``zs.shard``; ``set_adapter`` works unless it would train
#   a parameter the engine holds frozen. ``merge_adapter``/``unmerge_adapter`` at stage 3
#   are refused (they write the base weights in place, which are rows there).
# ----------------------------------------------------------------------------------------

#: Module hook dictionaries a copy of the module must not keep the engine's hooks in.
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def refuse_quantized(module: torch.nn.Module) -> None:
    """Quantized base weights (bitsandbytes' ``Params4bit``, ``Int8Params``: QLoRA) are
    packed integers with their own scales, which dim-0 rows cannot carry."""
    for name, p in module.named_parameters():
        if type(p).__name__ in ("Params4bit", "Int8Params"):
            raise NotImplementedError(
                f"zs.shard(): parameter {name!r} is a bitsandbytes {type(p).__name__} (a "
                "quantized base, QLoRA), which zeroshard does not shard; load the base in "
                "bf16 (at stage 3 its frozen weights are sharded: 2 bytes each over N ranks)")


def install(model) -> None:
    """Answer peft's calls on every peft model and tuner inside ``model.module``."""
    peft = sys.modules.get("peft")
    if peft is None:
        return  # no peft model can have been built
    from peft.tuners.tuners_utils import BaseTuner

    owner = weakref.ref(model)
    released = any(u.view.sharded for u in model.units)
    for m in model.module.modules():
        calls = {}
        if isinstance(m, peft.PeftModel):
            calls["save_pretrained"] = _peft_save_pretrained
        if isinstance(m, (peft.PeftModel, BaseTuner)):
            calls["set_adapter"] = _set_adapter
            calls["merge_and_unload"] = functools.partial(_on_a_copy, "merge_and_unload")
            calls["unload"] = functools.partial(_on_a_copy, "unload")
            for name in ("add_adapter", "load_adapter", "delete_adapter"):
                calls[name] = functools.partial(_refused, name)
            if released:
                for name in ("merge_adapter", "unmerge_adapter"):
                    calls[name] = functools.partial(_refused_at_stage3, name)
        for name, fn in calls.items():
            setattr(m, name, types.MethodType(functools.partial(fn, owner), m))


def _engine(owner):
    model = owner()
    if model is None:
        raise RuntimeError("the sharded model this module belonged to is gone")
    return model


def _prefix(model, module) -> str:
    name = next(n for n, m in model.module.named_modules() if m is module)
    return name + "." if name else ""


def _peft_save_pretrained(owner, module, save_directory, *args, **kwargs):
    """peft's ``save_pretrained``, with the adapter's full values gathered first."""
    if "state_dict" not in kwargs:
        model = _engine(owner)
        kwargs["state_dict"] = _adapter_state(model, module, kwargs.get("selected_adapters"),
                                              kwargs.get("save_embedding_layers", "auto"))
        kwargs.setdefault("is_main_process", dist.get_rank() == 0)
    return type(module).save_pretrained(module, save_directory, *args, **kwargs)


def _adapter_state(model, module, selected, embeddings) -> dict[str, torch.Tensor]:
    """The full values of what peft's ``save_pretrained`` writes of ``module``, under
    ``module``'s own keys. Collective: every rank gathers the same keys, in one order."""
    from peft.utils import get_peft_model_state_dict

    prefix = _prefix(model, module)
    held = {k[len(prefix):]: v for k, v in model.state_dict().items() if k.startswith(prefix)}
    marks = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in held.items()}
    key_of = {id(t): k for k, t in marks.items()}
    wanted = set()
    for name in selected or list(module.peft_config):
        picked = get_peft_model_state_dict(module, state_dict=dict(marks), adapter_name=name,
                                           save_embedding_layers=embeddings)
        wanted |= {key_of[id(t)] for t in picked.values() if id(t) in key_of}
    out = {}
    for k in sorted(wanted):
        v = held[k]
        out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


def _on_a_copy(method: str, owner, module, *args, **kwargs):
    """peft's ``method`` (``merge_and_unload``, ``unload``) on a whole copy of ``module``:
    every rank gets the same new, unsharded model; the sharded one is unchanged."""
    model = _engine(owner)
    prefix = _prefix(model, module)
    full = {k[len(prefix):]: v for k, v in model.full_state_dict().items()
            if k.startswith(prefix)}
    handles = [*model.hooks.handles, *model.guard.handles]
    ours = {h.id for h in handles}
    # the engine's hooks hold the engine (its process groups cannot be copied): the copy
    # takes them as they are, and drops them next
    hooks = [d.get(h.id) for h in handles if (d := h.hooks_dict_ref()) is not None]
    clone = copy.deepcopy(module, {id(f): f for f in hooks if f is not None})
    for m in clone.modules():
        for attr in _HOOK_DICTS:
            hooks = getattr(m, attr, None)
            for hid in ours & set(hooks or ()):
                del hooks[hid]
        for name, value in list(vars(m).items()):  # this file's and the guard's methods
            if isinstance(value, types.MethodType) and _ours(value.__func__):
                delattr(m, name)
        # compiled calls and forwards (hooks.py's borders, ShardedModel.compile, a compile
        # of the user's) are closures over the original module: the copy runs its own
        if _dynamo_wrapped(m._compiled_call_impl):
            m._compiled_call_impl = None
        if _dynamo_wrapped(vars(m).get("forward")):
            del m.forward
    clone.load_state_dict(full, assign=True)  # every parameter whole, plain, as trained
    return getattr(clone, method)(*args, **kwargs)


def _dynamo_wrapped(fn) -> bool:
    """Whether ``fn`` is torch.compile's or dynamo's disable's wrapper of a callable."""
    return fn is not None and hasattr(fn, "_torchdynamo_orig_callable")


def _ours(fn) -> bool:
    return fn is _save_pretrained or (isinstance(fn, functools.partial) and fn.func in _CALLS)


def _set_adapter(owner, module, adapter_name, *args, **kwargs):
    """peft's ``set_adapter``, unless it makes trainable a parameter the engine keeps
    frozen: it holds no gradient, master or optimizer state for one."""
    out = type(module).set_adapter(module, adapter_name, *args, **kwargs)
    model = _engine(owner)
    by_id = owners(model)
    woken = [n for n, p in module.named_parameters()
             if p.requires_grad and id(p) in by_id and by_id[id(p)][1]
             not in by_id[id(p)][0].trainable]
    if woken:
        for n in woken:
            module.get_parameter(n).requires_grad_(False)
        raise NotImplementedError(
            f"set_adapter({adapter_name!r}) would train {len(woken)} parameters the sharded "
            f"model keeps frozen (e.g. {woken[0]!r}): the engine takes what trains at "
            "zs.shard(); activate that adapter (peft's set_adapter) before sharding, or "
            "switch with set_adapter(name, inference_mode=True) to use it without training")
    return out


def _refused(name: str, owner, module, *args, **kwargs):
    raise NotImplementedError(
        f"{type(module).__name__}.{name}() on a sharded model: the engine took the model's "
        "parameters once, at zs.shard(), and cannot add or drop any; make every adapter "
        "(get_peft_model, add_adapter, load_adapter) before zs.shard()")


def _refused_at_stage3(name: str, owner, module, *args, **kwargs):
    raise NotImplementedError(
        f"{type(module).__name__}.{name}() at ZeRO stage 3: it writes the base weights in "
        "place, which are each rank's rows here; merge_and_unload() returns the merged "
        "model whole (every rank calls it), or merge in `zeroshard export --merge`")


#: This file's answers, as installed (a copy of the module drops them).
_CALLS = (_peft_save_pretrained, _set_adapter, _on_a_copy, _refused, _refused_at_stage3)
