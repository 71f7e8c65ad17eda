"""``zs.shard``: wrap a model so that the ordinary training loop runs ZeRO stage 0–3.

[Note: the step cycle] One optimizer step is a *cycle* of one or more backward passes:

1. forward: at stage 3 each unit is gathered in its pre-forward hook and released in
   its post-forward hook, which also arms a hook on its outputs that gathers it again
   when backward reaches it (FSDP's pre-backward hook).
2. backward: a unit is done when every trainable parameter of it has accumulated its
   gradient (a post-accumulate-grad hook per parameter) or, for parameters that got
   none, when backward ends (a queued autograd callback). Reductions are *issued in a
   fixed order* (the reverse of the units' forward order), so every rank issues the same
   sequence even when a rank's unused parameter makes a unit finish late there; the
   gradient reductions travel on their own process group, so they cannot interleave
   with stage 3's gathers. The local gradients are packed into the unit's
   communication buffer and freed at once (stage 0 all-reduces and lands the average in
   fresh full gradients; stages 2–3 reduce-scatter into the shard); stage 1
   reduce-scatters the accumulated full gradients too but keeps them, and only the last
   synchronised backward's result is kept. Stages 0–1 drop the full gradients after
   the step (stage 0's live on as the shards' ``.grad`` until ``zero_grad()``).
3. step: a global optimizer step pre-hook finishes the reductions and hands each shard
   its gradient; the post-hook brings the compute weights up to date (a cast at stages
   0 and 3, an all-gather at stages 1–2, awaited in the next forward).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from ..observe import memory as _memory
from ..observe.ledger import Ledger
from ..observe.profiler import Profiler
from .clip import clip_grad_norm
from .collectives import Collectives
from .config import ZeroConfig
from .construct import broadcast_state, build_units, check_same_model
from .dist import default_device
from .materialize import Materializer, has_meta
from .optim import check_optimizer, register_for_step_hooks
from .prefetch import Prefetcher
from .reduce import issue_reduce
from .unit import Unit, UnitState
from .units import select_units


class ShardedModel(nn.Module):
    """A model whose training state is sharded per :class:`ZeroConfig`.

    ``parameters()`` yields what this rank's optimizer owns: shards under the original
    names, shaped ``[rows owned, *shape[1:]]``."""

    def __init__(self, module: nn.Module, config: ZeroConfig, group=None, param_init=None,
                 seed: int = 0):
        super().__init__()
        if not dist.is_initialized():
            raise ValueError("no process group: call zs.init_distributed() before zs.shard()")
        self.module = module
        self.config = config
        self.stage = config.stage
        self.ledger = Ledger()
        device = default_device()
        # meta tensors stay where they are: units materialize them one at a time
        module._apply(lambda t: t if t.is_meta else t.to(device))
        check_same_model(module)
        self.comm = Collectives(self.ledger, group)
        if config.sync_module_states:
            with torch.no_grad():
                broadcast_state(module, self.comm)
        self._materializer = (Materializer(module, device, seed, param_init)
                              if has_meta(module) else None)
        self.units = build_units(module, select_units(module, config.units), config,
                                 self.comm, self._materializer)
        if self._materializer is not None:
            self._materializer.finish()
            self._materializer = None
        self._shard_ids = {id(s) for u in self.units for s in u.shards}
        position = {n: k for k, (n, _) in enumerate(module.named_parameters())}
        self._named_shards = sorted(((u.names[i], s) for u in self.units
                                     for i, s in enumerate(u.shards)),
                                    key=lambda ns: position[ns[0]])
        self._reduce_order = list(reversed(self.units))
        self._sync = True  # False inside no_sync()
        self._stepped = True  # the next backward starts a new cycle
        self._in_backward = False
        self._next_reduce = 0
        self._bucket: list[Unit] = []  # ready units whose reduction waits for more
        self._flying: list[list[Unit]] = []  # issued reductions, oldest first
        u0 = self.units[0]
        self._bounded = self.stage > 0 or u0.reduce_dtype.itemsize > u0.grad_dtype.itemsize
        self._unreduced = False  # local gradients accumulated under no_sync()
        self._finalized = False
        self._checked: set[int] = set()
        self._prefetch = Prefetcher(config.prefetch, config.prefetch_bucket_size)  # stage 3
        self.profiler = Profiler(self) if config.profile else None
        if self.profiler is not None:
            for u in self.units:
                u.prof = self.profiler
        self._register_hooks()
        register_for_step_hooks(self)
        self.ledger.reset()  # comm_stats() counts training, not set-up

    # -- construction ---------------------------------------------------------------
    def _register_hooks(self) -> None:
        prof = self.profiler
        owner, handles = weakref.ref(self), []
        weakref.finalize(self, _remove_hooks, handles)
        for k, u in enumerate(self.units):
            if prof is not None:  # before the gather and before the release
                u.module.register_forward_pre_hook(
                    lambda m, a, u=u: prof.event("forward_begin", u), prepend=True)
                u.module.register_forward_hook(
                    lambda m, a, out, u=u: prof.event("forward_end", u), prepend=True)
            # A tensor's hooks are held from C++, where the cycle collector cannot see
            # them: a hook holding the engine or a unit would keep both (and their
            # process groups) alive for the life of the interpreter. So they hold it
            # weakly, and go with it.
            for i in u.trainable:
                handles.append(u.params[i].register_post_accumulate_grad_hook(
                    functools.partial(_grad_hook, owner, k)))
            if u.stage == 3:
                u.module.register_forward_pre_hook(
                    lambda m, a, u=u: self._gather(u, "forward"))
                u.module.register_forward_hook(lambda m, a, out, u=u: self._post_forward(u, out))

    # -- forward and backward -------------------------------------------------------
    def forward(self, *args, **kwargs):
        for u in self.units:
            u.wait_sync()
        dtype = self.units[0].compute_dtype
        if dtype != torch.float32:  # inputs follow the compute dtype (FSDP2: cast_forward_inputs)
            cast = lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        if self.profiler is not None and self.profiler.enabled:
            with self.profiler.saved_tensors():
                out = self.module(*args, **kwargs)
        else:
            out = self.module(*args, **kwargs)
        self._prefetch.end_pass("forward")
        tensors = [t for t in tree_flatten(out)[0] if torch.is_tensor(t) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads: self._on_backward_begin(), mode="any")
        return out

    def _post_forward(self, unit: Unit, out) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # activation checkpointing recomputes inside backward: keep it gathered
        unit.release()
        tensors = [t for t in tree_flatten(out)[0] if torch.is_tensor(t) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads: self._gather(unit, "backward"), mode="any")

    def _gather(self, unit: Unit, phase: str) -> None:
        """Gather ``unit`` for use and prefetch the next ones (``prefetch.py``)."""
        if phase == "backward" and self.profiler is not None:
            self.profiler.event("backward_begin", unit)
        if phase == "forward" and torch._C._current_graph_task_id() != -1:
            unit.gather()  # activation checkpointing's recompute: not a forward pass
            return
        self._prefetch.use(unit, phase)


    def _on_backward_begin(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        new_cycle = self._stepped
        self._stepped = False
        self._finalized = False
        self._next_reduce = 0
        for u in self.units:
            u.wait_reduce()  # stage 0 writes back into the gradients this backward adds to
            u.start_backward(new_cycle)
        self._flying = []
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_grad(self, unit: Unit) -> None:
        unit.pending_grads -= 1
        if unit.pending_grads == 0:
            self._unit_done(unit)

    def _unit_done(self, unit: Unit) -> None:
        unit.ready = True
        if self.profiler is not None:
            self.profiler.event("backward_end", unit)
        if unit.stage == 3:
            unit.release()
        self._issue_ready()

    def _issue_ready(self, flush: bool = False) -> None:
        """Issue reductions strictly in ``_reduce_order``: the same sequence on every rank."""
        order = self._reduce_order
        while self._next_reduce < len(order) and order[self._next_reduce].ready:
            if self._sync:
                self._bucket_add(order[self._next_reduce])
            self._next_reduce += 1
        if flush:
            self._bucket_flush()

    def _bucket_add(self, unit: Unit) -> None:
        self._bucket.append(unit)
        size = self.config.reduce_bucket_size
        if sum(u.g_layout.numel for u in self._bucket) >= size:
            self._bucket_flush()

    def _bucket_flush(self) -> None:
        """Issue the pending bucket. At most two reductions stay in flight: the oldest is
        landed (its communication buffer freed) before a third starts, so the buffers
        never add up to another copy of the gradients. Stage 0 needs no bound when it
        reduces in the gradients' own dtype: its local gradients are freed as their
        buffer is filled and the buffer is freed as the average lands, so the buffers in
        flight hold what the gradients would. Reduced in a wider dtype (bf16 gradients
        summed in fp32) they would hold more, so the bound applies again."""
        if self._bucket:
            issue_reduce(self._bucket, free_full=self.stage != 1)
            self._flying.append(self._bucket)
            self._bucket = []
            while self._bounded and len(self._flying) > 2:
                for u in self._flying.pop(0):
                    u.wait_reduce()

    def _on_backward_end(self) -> None:
        for u in self._reduce_order[self._next_reduce:]:
            if not u.ready:
                self._unit_done(u)
        self._issue_ready(flush=True)
        for u in self.units:
            if u.stage == 3 and u.state is not UnitState.SHARDED:
                u.release()  # used by no backward this step, or prefetched and unused
        self._prefetch.end_pass("backward")
        self._unreduced = not self._sync
        self._in_backward = False

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, with no communication, until the context exits.

        Stages 0–1 keep full gradients anyway. Stages 2–3 then also keep the full
        gradients (2P bytes under bf16, as at stage 1) until the first backward outside
        the context reduces them."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    # -- the step -------------------------------------------------------------------
    def _finalize_grads(self) -> None:
        """Finish every reduction and give each shard its gradient (idempotent)."""
        if self._finalized:
            return
        if self._in_backward:
            raise ValueError("gradients are not final during backward")
        if self._unreduced:  # the last backward ran under no_sync()
            for u in self._reduce_order:
                self._bucket_add(u)
            self._bucket_flush()
            self._unreduced = False
        for u in self._reduce_order:
            u.wait_reduce()
        # Which parameters some rank saw (a parameter no rank used gets no update, as under
        # torch DDP): one host synchronisation for all units at once. Stage 0 has also read
        # each unit's flags as it landed them (Unit._land_full_grads).
        counted = [u for u in self._reduce_order if u.presence is not None]
        if counted:
            present = (torch.cat([u.presence for u in counted]) > 0).tolist()
            for u in counted:
                u.assign_step_grads(present[:len(u.trainable)])
                present = present[len(u.trainable):]
        self._flying = []
        self._finalized = True

    def _before_step(self, optimizer) -> None:
        if id(optimizer) not in self._checked:
            check_optimizer(optimizer, self.stage)
            self._checked.add(id(optimizer))
        if self.profiler is not None:
            self.profiler.optimizer = optimizer
            self.profiler.event("step_begin")
        self._finalize_grads()

    def _after_step(self) -> None:
        # Stages 1-2 all-gather the updated weights unit by unit; at most two gathers are in
        # flight, so the gathered buffers never add up to a second copy of the model.
        prev = None
        for u in self.units:
            u.after_step()
            if prev is not None:
                prev.wait_sync()
            prev = u
        self._stepped = True
        if self.profiler is not None:
            self.profiler.event("step_end")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the shards' gradients and start a new accumulation cycle."""
        super().zero_grad(set_to_none)
        self._stepped = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over all ranks' shards (padding never counts); return
        the norm (see :func:`zeroshard.runtime.clip.clip_grad_norm`)."""
        self._finalize_grads()
        return clip_grad_norm(self.units, self.comm, self.stage, max_norm, norm_type)

    # -- inspection -----------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        for name, shard in self._named_shards:
            yield prefix + name, shard

    def synchronize(self) -> None:
        """Finish the communication a step leaves in flight: at stages 1-2, the
        all-gathers that bring the compute weights up to date (the next forward waits
        for them itself). For timing a step whole, or reading the weights in between."""
        for u in self.units:
            u.wait_sync()

    def _refresh_compute(self) -> None:
        """Recompute every compute weight from the shards (after a load)."""
        for u in self.units:
            u.refresh_compute()
        self.synchronize()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded weights (the fp32 master where there is one) and buffers under
        their original names. A collective: every rank must call it."""
        self.synchronize()
        values = {}
        for u in self.units:
            values.update(u.full_tensors())
        by_id = {id(p): values[n] for u in self.units for n, p in zip(u.names, u.params)}
        out = {}
        for key, t in self.module.state_dict(keep_vars=True).items():
            out[key] = by_id[id(t)] if id(t) in by_id else t.detach().clone()
        return out

    def memory(self, optimizer=None) -> dict[str, int]:
        """Bytes on this rank per category: params, grads, optimizer (master + state of
        ``optimizer``), padding, and the transient gathered and buffers."""
        return _memory.measure(self.units, optimizer)

    def comm_stats(self, reset: bool = False) -> dict[str, dict[str, int]]:
        """Per collective kind: calls and bytes this rank sent (ring accounting)."""
        stats = self.ledger.comm_stats()
        if reset:
            self.ledger.reset()
        return stats


def _remove_hooks(handles: list) -> None:
    for h in handles:
        h.remove()


def _grad_hook(owner: weakref.ref, k: int, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a trainable parameter of ``owner().units[k]``."""
    model = owner()
    if model is not None:
        model._on_grad(model.units[k])


def shard(model: nn.Module, stage: int | None = None, *, config=None, group=None,
          param_init=None, seed: int = 0, **options) -> ShardedModel:
    """Shard ``model`` over the data-parallel group (default: the whole world).

    ``stage`` and ``options`` are :class:`ZeroConfig` fields (``mixed_precision``,
    ``units``, ``reduce_dtype``, ``param_persistence_threshold``, ...); they override
    ``config``, which may be a ZeroConfig, a dict of its fields, a DeepSpeed config dict,
    or a path to either as JSON.

    A model built under ``torch.device("meta")`` is materialized one unit at a time:
    each module is initialised by ``param_init(module)`` (default: its
    ``reset_parameters()``) under a seed derived from ``seed`` and its name, exactly as
    ``zs.init_weights(model, seed, param_init)`` initialises an ordinary model."""
    base = ZeroConfig.load(config) if config is not None else ZeroConfig()
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(f"zs.shard() got unknown options {unknown}; accepted: "
                         f"{sorted(fields)}")
    if stage is not None:
        options["stage"] = stage
    if options:
        base = ZeroConfig(**{**fields, **options})
    return ShardedModel(model, base, group, param_init, seed)
