"""The sharded model: the ordinary training loop over ZeRO stage 0-3.

[Note: the step cycle] One optimizer step is a *cycle* of one or more backward passes
(``cycle.py`` names its states):

1. forward: where parameters are sharded (stage 3) each unit is gathered in its
   pre-forward hook and released in its post-forward hook, which also arms a hook on
   its outputs that gathers it again when backward reaches it (FSDP's pre-backward
   hook); ``prefetch.py`` issues the next gathers early.
2. backward: each unit's gradients are reduced as soon as it is done, in one order on
   every rank (``backward.py``), packed into one buffer per unit (``reduce.py``).
3. step: a global optimizer step pre-hook finishes the reductions and hands each shard
   its gradient; the post-hook brings the compute weights up to date (``policy.py``:
   a cast, or an all-gather awaited in the next forward).
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from ...spec.config import ZeroConfig
from ...spec.policy import ShardPolicy
from ..build.construct import broadcast_buffers, broadcast_state, build_units, check_same_model
from ..build.materialize import Materializer, has_meta
from ..build.units import select_units
from ..comm.collectives import Collectives
from ..dist import default_device
from ..events import Events
from ..ledger import Ledger
from ..schedule.backward import Reducer
from ..schedule.prefetch import Prefetcher
from ..step.cycle import CycleState, StepCycle
from ..step.optim import register_for_step_hooks
from ..step.stepping import Stepping
from ..unit.unit import Unit
from .readout import Readout


class ShardedModel(Stepping, Readout, nn.Module):
    """A model whose training state is sharded per :class:`ZeroConfig`.

    ``parameters()`` yields what this rank's optimizer owns: shards under the original
    names, shaped ``[rows owned, *shape[1:]]``."""

    def __init__(self, module: nn.Module, config: ZeroConfig, group=None, param_init=None,
                 seed: int = 0):
        super().__init__()
        if not dist.is_initialized():
            raise ValueError("no process group: call zs.init_distributed() before zs.shard()")
        inner = next((m for m in module.modules() if isinstance(m, ShardedModel)), None)
        if inner is not None:
            raise ValueError(
                f"{type(module).__name__} is already sharded (a ShardedModel at stage "
                f"{inner.policy.stage} is inside it): zs.shard() takes the original module "
                "once; use the sharded model as it is, or shard a fresh module")
        self._original_ids = {id(p) for p in module.parameters()}
        self.module = module
        self.zero_config = config
        """The :class:`ZeroConfig` this model was sharded with (``model.config`` is the
        wrapped module's, as for every attribute the sharded model does not have)."""
        self.policy = ShardPolicy.from_config(config)
        self.events = Events()
        """Lifecycle events (``events.py``); the profiler subscribes here."""
        self.ledger = Ledger()
        device = default_device()
        # meta tensors stay where they are: units materialize them one at a time
        module._apply(lambda t: t if t.is_meta else t.to(device))
        check_same_model(module, config)
        self.comm = Collectives(self.ledger, group, check=config.check_collectives,
                                shard_group=config.shard_group,
                                secondary_group=config.secondary_group,
                                quantize_weights=config.quantize_weights,
                                quantize_grads=config.quantize_grads,
                                quant_block=config.quant_block)
        if config.sync_module_states:
            with torch.no_grad():
                broadcast_state(module, self.comm)
        materializer = Materializer(module, device, seed, param_init) if has_meta(module) else None
        self.units = build_units(module, select_units(module, config.units), config, self.policy,
                                 self.comm, materializer, self.events)
        if materializer is not None:
            materializer.finish()
        self._shard_ids = {id(s) for u in self.units for s in u.shards}
        position = {n: k for k, (n, _) in enumerate(module.named_parameters())}
        self._named_shards = sorted(((u.names[i], s) for u in self.units
                                     for i, s in enumerate(u.shards)),
                                    key=lambda ns: position[ns[0]])
        self.reducer = Reducer(self.units, config.reduce_bucket_size)
        self.comm.unit_names = [u.name for u in self.units]
        self.cycle = StepCycle()
        self._init_stepping()
        self._prefetch = Prefetcher(config.prefetch, config.prefetch_bucket_size)
        self.profiler = None
        """The profiler, when ``zs.shard(..., profile=True)`` attached one."""
        self._hold = False  # inside gathered(): stage-3 units stay gathered
        self._register_hooks()
        register_for_step_hooks(self)
        self.ledger.reset()  # comm_stats() counts training, not set-up
        self.comm.phase = "between steps"

    @property
    def stage(self) -> int:
        """The ZeRO stage (for reports; the engine asks ``policy``)."""
        return self.policy.stage

    # -- construction ---------------------------------------------------------------
    def _register_hooks(self) -> None:
        # the root's hooks run first and last: every forward of the module, through this
        # model or through a method of the module itself (generate), is prepared alike
        self.module.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True,
                                              prepend=True)
        self.module.register_forward_hook(self._root_post_forward, with_kwargs=True)
        owner, handles = weakref.ref(self), []
        weakref.finalize(self, _remove_hooks, handles)
        for k, u in enumerate(self.units):
            # A tensor's hooks are held from C++, where the cycle collector cannot see
            # them: a hook holding the engine or a unit would keep both (and their
            # process groups) alive for the life of the interpreter. So they hold it
            # weakly, and go with it.
            for i in u.trainable:
                handles.append(u.params[i].register_post_accumulate_grad_hook(
                    functools.partial(_grad_hook, owner, k)))
            u.module.register_forward_pre_hook(lambda m, a, u=u: self._pre_forward(u))
            u.module.register_forward_hook(lambda m, a, out, u=u: self._post_forward(u, out))

    # -- forward and backward -------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.events.listeners:
            with self.events.forward_context():
                return self.module(*args, **kwargs)
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        """The wrapped module's attributes and methods (``generate``, ``config``,
        ``gradient_checkpointing_enable``...) where the sharded model has none of its
        own, as FSDP2 keeps the module's own."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")  # none while unpickling
            if module is None:
                raise
            return getattr(module, name)

    def _root_pre_forward(self, module, args, kwargs):
        if torch._C._current_graph_task_id() != -1:
            return None  # activation checkpointing's recompute
        self.comm.phase = "forward"
        for u in self.units:
            u.wait_sync()
        if torch.is_grad_enabled() and self.cycle.state is CycleState.FINAL:
            for u in self.units:  # another micro-batch: its backward makes them anew
                u.drop_step_grads()
        if self.zero_config.broadcast_buffers and torch.is_grad_enabled() and self.reducer.sync:
            broadcast_buffers(module, self.comm)  # as torch DDP, before every forward
        dtype = self.units[0].compute_dtype
        if dtype == torch.float32:
            return None
        # inputs follow the compute dtype (FSDP2: cast_forward_inputs)
        cast = lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
        return tree_map(cast, args), tree_map(cast, kwargs)

    def _root_post_forward(self, module, args, kwargs, out):
        if torch._C._current_graph_task_id() != -1:
            return
        self._prefetch.end_pass("forward")
        tensors = [t for t in tree_flatten(out)[0] if torch.is_tensor(t) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads: self._on_backward_begin(), mode="any")

    def _pre_forward(self, unit: Unit) -> None:
        self.events.emit("forward_begin", unit)
        if not unit.policy.shards_params or self._hold:
            return
        if torch._C._current_graph_task_id() != -1:
            unit.gather()  # activation checkpointing's recompute: not a forward pass
        else:
            self._prefetch.use(unit, "forward")

    def _post_forward(self, unit: Unit, out) -> None:
        self.events.emit("forward_end", unit)
        if (not unit.policy.shards_params or self._hold
                or torch._C._current_graph_task_id() != -1):
            return  # activation checkpointing recomputes inside backward: keep it gathered
        unit.release(keep_secondary=torch.is_grad_enabled())  # hpZ: for its backward
        tensors = [t for t in tree_flatten(out)[0] if torch.is_tensor(t) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads: self._pre_backward(unit), mode="any")

    def _pre_backward(self, unit: Unit) -> None:
        self.events.emit("backward_begin", unit)
        self._prefetch.use(unit, "backward")

    def _on_backward_begin(self) -> None:
        if self.cycle.state is CycleState.BACKWARD:
            return  # another output of the same backward
        if self._hold:
            raise ValueError("a backward pass began inside model.gathered(), which holds "
                             "the full weights for inference: train outside it")
        new_cycle = self.cycle.new_cycle
        self.cycle.advance("backward_begin")
        self.comm.phase = "backward"
        self._stepped_by = None
        self._cycle_norm = self._verdict = None  # this backward changes the gradients
        self.reducer.begin(new_cycle)
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        self.reducer.end()
        self._prefetch.end_pass("backward")
        self.cycle.advance("backward_end" if self.reducer.sync else "backward_end_unreduced")
        if self.reducer.sync:  # shards hold their reduced .grad once backward ends (FSDP2)
            self._finalize_grads()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, with no communication, until the context exits.

        Stages 0–1 keep full gradients anyway. Stages 2–3 then also keep the full
        gradients (2P bytes under bf16, as at stage 1) until the first backward outside
        the context reduces them."""
        self.reducer.sync = False
        try:
            yield
        finally:
            self.reducer.sync = True

    # -- inspection -----------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        for name, shard in self._named_shards:
            yield prefix + name, shard

    def named_shards(self) -> list[tuple[str, nn.Parameter]]:
        """``(original name, shard)`` for every parameter, in the module's order."""
        return list(self._named_shards)

    def holds_any(self, ids: set[int]) -> bool:
        """Whether any of the tensor ids ``ids`` is one of this model's shards."""
        return not self._shard_ids.isdisjoint(ids)

    def covers_trainable(self, ids: set[int]) -> bool:
        """Whether ``ids`` are shards of this model and include every trainable one."""
        return ids <= self._shard_ids and all(
            id(s) in ids for _, s in self._named_shards if s.requires_grad)

    def holds_original(self, ids: set[int]) -> bool:
        """Whether any of ``ids`` is a parameter of the module as it was before
        sharding (an optimizer built before ``zs.shard`` holds those)."""
        return not self._original_ids.isdisjoint(ids)


def _remove_hooks(handles: list) -> None:
    for h in handles:
        h.remove()


def _grad_hook(owner: weakref.ref, k: int, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a trainable parameter of ``owner().units[k]``."""
    model = owner()
    if model is not None:
        model.reducer.on_grad(model.units[k])
