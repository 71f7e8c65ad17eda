"""The sharded model the user holds: :class:`ShardedModel`, its collaborators and public
methods, and what it gives out (full weights, bytes held).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.distributed as dist
import torch.nn as nn

from ..spec.config import ZeroConfig
from . import checkpointing
from .build import (
    Materializer,
    broadcast_buffers,
    broadcast_state,
    build_units,
    check_same_model,
    has_meta,
    select_units,
)
from .collectives import Collectives, TPCounter
from .cycle import StepCycle
from .dist import default_device
from .dtensor import load_into, owners, state_dict_of
from .events import Events
from .hooks import PassHooks
from .ledger import Ledger
from .mesh import Mesh, check_mesh, check_tp_params
from .schedule import CommContext, Prefetcher, Reducer
from .stepping import Stepper, register_for_step_hooks
from .unit import UnitState, disk_bytes, full_tensors, host_bytes, measure, tp_dim
from .wrapped import ModuleGuard, refuse_quantized
from .wrapped import install as install_peft_calls

# ----------------------------------------------------------------------------------------
# What a sharded model gives out besides its state dict (``dtensor.py``): its full
# weights, and the bytes it holds and sends.
# ----------------------------------------------------------------------------------------

def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Full, unsharded weights (the fp32 master where there is one) and buffers under
    their original names. A collective: every rank must call it. With
    ``broadcast_buffers`` the buffers are rank 0's (broadcast first, as the next
    forward would), so every rank returns the same state."""
    model.synchronize()
    if model.zero_config.broadcast_buffers:
        broadcast_buffers(model.module, model.comm)
    values = {}
    for u in model.units:
        values.update(full_tensors(u))
        for i, p in enumerate(u.params):  # tensor parallelism's slices, whole
            d = tp_dim(p)
            if d is not None and model.mesh.tp_world > 1:
                values[u.names[i]] = model.comm.gather_tp(values[u.names[i]], d)
    by_id = owners(model)  # full parameters, and the DTensors released units show
    out = {}
    for key, t in model.module.state_dict(keep_vars=True).items():
        if id(t) in by_id:
            u, i = by_id[id(t)]
            out[key] = values[u.names[i]]
        else:
            out[key] = t.detach().clone()
    return out


def memory(model, optimizer=None, by_placement: bool = False) -> dict:
    """Bytes on this rank per category: params, grads, optimizer (master + state of
    ``optimizer``), padding, and the transient gathered and buffers. With
    ``by_placement``, ``{"device": {...}, "host": {...}, "disk": {...}}``: what
    offload keeps in host memory apart (``ZeroConfig.offload``), and what disk
    offload keeps in files (``ZeroConfig.offload_dir``; the host then holds the
    step's sub-group buffers)."""
    total = measure(model.units, optimizer)
    streamed = model.stepper.disk_step.buffer_bytes() if model.stepper.disk_step is not None else 0
    total["buffers"] += streamed  # disk offload's sub-group buffers, on the host
    if not by_placement:
        return total
    host, disk = dict.fromkeys(total, 0), dict.fromkeys(total, 0)
    host["buffers"] += streamed
    for u in model.units:
        for c, b in host_bytes(u, optimizer).items():
            host[c] += b
        for c, b in disk_bytes(u).items():
            disk[c] += b
    return {"device": {c: total[c] - host[c] - disk[c] for c in total}, "host": host,
            "disk": disk}


# ----------------------------------------------------------------------------------------
# The sharded model: the ordinary training loop over ZeRO stage 0-3.
#
# [Note: the step cycle] One optimizer step is a *cycle* of one or more backward passes
# (``stepping.py`` names its states):
#
# 1. forward: where parameters are sharded (stage 3) each unit is gathered before its
#    forward and released after it, arming a hook on its outputs that gathers it again
#    for backward (FSDP's pre-backward hook); ``schedule.py`` gathers ahead.
# 2. backward: each unit's gradients are reduced as soon as it is done, in one order on
#    every rank (``schedule.py``), packed into one buffer per unit
#    (``schedule.py``).
# 3. step: a global optimizer step pre-hook finishes the reductions and hands each shard
#    its gradient; the post-hook brings the compute weights up to date (a cast, or an
#    all-gather awaited in the next forward).
#
# :class:`ShardedModel` builds its collaborators once and owns them (the mesh, the
# collectives, the units, the reducer, the prefetcher, the step cycle, the pass hooks of
# ``hooks.py``, the stepper); its public methods are ``nn.Module``'s and a few more.
# ----------------------------------------------------------------------------------------

#: "auto" gathers the whole model for generation where free memory is this many times its
#: full weights: a fifth beyond them for the generation's activations and cache.
GENERATE_HEADROOM = 1.25


def free_bytes(device: torch.device) -> int | None:
    """Bytes still free where ``device``'s tensors live: the GPU's, or this machine's
    available memory for the CPU; None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    from .._host import available_bytes

    return available_bytes()


def _takes(fn, name: str) -> bool:
    """Whether callable ``fn`` takes the keyword ``name`` (by name, or through **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


class _SignedForward:
    """``ShardedModel.forward``: the model's forward, under the wrapped module's signature.
    Code that reads the signature to pick its inputs — transformers' Trainer drops every
    dataset column its model's ``forward`` does not name (``_set_signature_columns_if_
    needed`` in ``trainer.py``) — found ``(*args, **kwargs)`` and named nothing. Each
    access gives ``_forward`` bound to the model with the module's ``__signature__``,
    read once per model."""

    def __get__(self, model, owner=None):
        if model is None:
            return owner._forward
        signature = model.__dict__.get("_forward_signature")
        if signature is None:
            try:
                signature = inspect.signature(model.module.forward)
            except (TypeError, ValueError):  # a forward torch cannot describe (a builtin)
                signature = inspect.signature(owner._forward)
            model.__dict__["_forward_signature"] = signature
        bound = functools.partial(owner._forward, model)
        bound.__signature__ = signature
        return bound


class ShardedModel(nn.Module):
    """A model whose training state is sharded per :class:`ZeroConfig`.

    ``parameters()`` yields what this rank's optimizer owns: shards under the original
    names, shaped ``[rows owned, *shape[1:]]``."""

    def __init__(self, module: nn.Module, config: ZeroConfig, group=None, param_init=None,
                 seed: int = 0, mesh=None):
        super().__init__()
        if not dist.is_initialized():
            raise ValueError("no process group: call zs.init_distributed() before zs.shard()")
        inner = next((m for m in module.modules() if isinstance(m, ShardedModel)), None)
        if inner is not None:
            raise ValueError(
                f"{type(module).__name__} is already sharded (a ShardedModel at stage "
                f"{inner.policy.stage} is inside it): zs.shard() takes the original module "
                "once; use the sharded model as it is, or shard a fresh module")
        refuse_quantized(module)
        self._original_ids = {id(p) for p in module.parameters()}
        self.module = module
        self.zero_config = config
        """The :class:`ZeroConfig` this model was sharded with (``model.config`` is the
        wrapped module's, as for every attribute the sharded model does not have)."""
        self.policy = config.policy
        self.events = Events()
        """Lifecycle events (``events.py``); the profiler subscribes here."""
        self.ledger = Ledger()
        device = default_device()
        # meta tensors stay where they are: units materialize them one at a time
        module._apply(lambda t: t if t.is_meta else t.to(device))
        check_same_model(module, config)
        if mesh is not None:
            check_mesh(mesh)
        check_tp_params(module, mesh)
        self.mesh = Mesh.build(group, config.shard_group, config.secondary_group, mesh)
        """Every process group, rank and size of this model (``runtime/mesh.py``)."""
        self.cycle = StepCycle()
        """Where the model is in its passes and its step (``cycle.py``)."""
        self.comm = Collectives(self.ledger, self.mesh, check=config.check_collectives,
                                quantize_weights=config.quantize_weights,
                                quantize_grads=config.quantize_grads,
                                quant_block=config.quant_block, cycle=self.cycle)
        self.ctx = CommContext()
        if config.sync_module_states:
            with torch.no_grad():
                broadcast_state(module, self.comm)
        materializer = Materializer(module, device, seed, param_init) if has_meta(module) else None
        self.units = build_units(module, select_units(module, config.units), config, self.policy,
                                 self.comm, self.ctx, materializer, self.events)
        if materializer is not None:
            materializer.finish()
        self._shard_ids = {id(s) for u in self.units for s in u.shards}
        position = {n: k for k, (n, _) in enumerate(module.named_parameters())}
        self._named_shards = sorted(((u.names[i], s) for u in self.units
                                     for i, s in enumerate(u.shards)),
                                    key=lambda ns: position[ns[0]])
        self.reducer = Reducer(self.units, config.reduce_bucket)
        self.comm.unit_names = [u.name for u in self.units]
        self.prefetcher = Prefetcher(config.prefetch, config.prefetch_bucket_size)
        self.stepper = Stepper(self.units, self.comm, self.reducer, self.cycle, self.policy,
                               config, self.events, self._named_shards)
        self.tp_counter = TPCounter(self.comm) if self.mesh.tp_world > 1 else None
        """Counts tensor parallelism's collectives for the ledger (``collectives.py``)."""
        if self.tp_counter is not None:
            self.events.subscribe(self.tp_counter)
        self.profiler = None
        """The profiler, when ``zs.shard(..., profile=True)`` attached one."""
        self.hooks = PassHooks(self)
        self.guard = ModuleGuard(self)  # loading and saving through the module itself
        install_peft_calls(self)  # peft's calls on the module: save_pretrained, merges, ...
        self.checkpointed_units = checkpointing.apply(self)
        """How many units recompute their forward in backward (``checkpointing.py``)."""
        # an optimizer over the DTensors released units show is one over the module's own
        self._original_ids |= {id(p) for u in self.units for p in u.view.sharded or ()}
        register_for_step_hooks(self)
        self.ledger.reset()  # comm_stats() counts training, not set-up
        self.cycle.ready()

    @property
    def stage(self) -> int:
        """The ZeRO stage (for reports; the engine asks ``policy``)."""
        return self.policy.stage

    @property
    def _ddp_params_and_buffers_to_ignore(self):
        """torch DDP around a sharded model (transformers' Trainer and accelerate put any
        model they are handed in it) would all-reduce the shards' gradients again, after
        the engine reduced them, and train another model. ``DistributedDataParallel``
        reads this attribute of the module it wraps at construction
        (``torch/nn/parallel/distributed.py``; ``hasattr`` lets any error but
        AttributeError through), so DDP stops here, before any step, in one line."""
        raise ValueError(
            "zeroshard: a ShardedModel cannot be wrapped in torch DistributedDataParallel "
            "(by transformers' Trainer, accelerate, Lightning's DDP or by hand): it reduces "
            "its own gradients, and DDP would reduce them again and train another model; "
            "with Hugging Face's Trainer use zeroshard.hf.Trainer(model=<the unsharded "
            "model>, zero=...), with Lightning strategy='zeroshard', in a loop of your own "
            "call the sharded model itself")

    # -- the training loop ----------------------------------------------------------
    def _forward(self, *args, **kwargs):
        if self.events.listeners:
            with self.events.forward_context():
                return self.module(*args, **kwargs)
        return self.module(*args, **kwargs)

    forward = _SignedForward()

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

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, with no communication, until the context exits.

        Stages 0–1 keep full gradients anyway. Stages 2–3 then also keep the full
        gradients (2P bytes under bf16, as at stage 1) until the first backward outside
        the context reduces them."""
        before, self.reducer.sync = self.reducer.sync, False
        try:
            yield
        finally:
            self.reducer.sync = before

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag, honoured as DDP honours it: ``False`` is ``no_sync()`` until
        it is set back to ``True`` (nanoGPT sets it on every micro-step, True on the last)."""
        return self.reducer.sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.reducer.sync = bool(value)

    def compile(self, *args, **kwargs) -> None:
        """``torch.compile`` each unit's computation, in place, as torchtitan compiles each
        block before sharding it: the ``forward`` of every unit's module but the root's
        is compiled with these arguments, and the engine's hooks around it stay eager.
        ``torch.compile(model)`` compiles the model whole instead; each unit's call is
        then a graph border (``hooks.py``)."""
        for u in self.units:
            m = u.module
            if m is self.module:
                continue
            if checkpointing.is_checkpointed(m.forward):
                m.forward.compile(*args, **kwargs)
            elif "forward" not in vars(m):
                m.forward = torch.compile(m.forward, *args, **kwargs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip by the global norm over all ranks' shards (padding never counts); return
        the norm (see :func:`zeroshard.runtime.stepping.global_norm`). A non-finite
        norm raises with ``error_if_nonfinite`` (as torch's), and otherwise leaves the
        decision to ``ZeroConfig.nonfinite`` at the step, with no further exchange."""
        return self.stepper.clip(max_norm, norm_type, error_if_nonfinite)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the shards' gradients and start a new accumulation cycle."""
        self.stepper.zero_grad()
        super().zero_grad(set_to_none)

    @property
    def steps(self) -> int:
        """Optimizer steps taken (skipped ones included): every rank counts alike."""
        return self.cycle.steps

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients (``nonfinite="skip"``, or a loss scaler)."""
        return self.stepper.skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest optimizer step was skipped for non-finite gradients."""
        return self.stepper.last_step_skipped

    @property
    def loss_scaler(self):
        """The :class:`~zeroshard.runtime.scaler.GradScaler` made for it, if any."""
        return self.stepper.loss_scaler

    # -- weights in and out ---------------------------------------------------------
    def synchronize(self) -> None:
        """Finish the communication a step leaves in flight: at stages 1-2, the
        all-gathers that bring the compute weights up to date (the next forward waits
        for them itself). For timing a step whole, or reading the weights in between."""
        for u in self.units:
            u.wait_sync()

    def refresh_compute(self) -> None:
        """Recompute every compute weight from the shards (after the shards were
        written directly, as a checkpoint load does). A collective at stages 1-2."""
        for u in self.units:
            u.refresh_compute()
        self.synchronize()

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False):
        """What this rank holds of every parameter (the master where there is one) as a
        DTensor of the full shape — ``Shard(0)`` where sharded, ``Replicate()`` where
        whole — and the persistent buffers, under the module's own names; no collective
        ([Note: state dict] in ``dtensor.py``). ``full_state_dict()`` gathers full
        weights."""
        return state_dict_of(self, destination, prefix, keep_vars)

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """Load DTensors, full tensors or this rank's rows, per key; master, shards and
        compute weights agree afterwards. Every rank calls it (a collective at stages
        1-2)."""
        if assign:
            raise NotImplementedError("load_state_dict(assign=True) would replace the shards "
                                      "the optimizer holds; load with assign=False")
        return load_into(self, state_dict, strict)

    def _fqn_modifiers(self) -> dict[str, str]:
        """The state dict's keys are the module's own: to torch's state-dict functions
        (``_get_fqns`` in ``torch/distributed/checkpoint/state_dict.py``) each first name
        lies under the ``module`` attribute, which the keys leave out."""
        m = self.module
        return {n: "module" for n in (*m._modules, *m._parameters, *m._buffers)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded weights (the fp32 master where there is one) and buffers under
        their original names. A collective: every rank must call it. With
        ``broadcast_buffers`` the buffers are rank 0's (broadcast first, as the next
        forward would), so every rank returns the same state."""
        return full_state_dict(self)

    @contextlib.contextmanager
    def gathered(self):
        """Hold every unit's full weights for the context: forwards inside it (a
        sampling loop whose ranks stop at different lengths, an evaluation) issue no
        collective, so ranks may run different numbers of them. Entering is a collective
        (stage 3 gathers each unit once); the weights are released at exit, the memory
        back to the stage's figure. For inference: a backward inside is refused."""
        self.synchronize()
        held = [u for u in self.units if u.policy.shards_params]
        for u in held:
            u.gather()
        try:
            with self.cycle.holding():
                yield self
        finally:
            for u in held:
                u.release()

    def generate(self, *args, **kwargs):
        """The wrapped module's ``generate`` (transformers', peft's), needing no care at
        any stage ([Note: generation] in ``cycle.py``): at stage 3 the weights are
        gathered once for the whole generation (``ZeroConfig.generate_gather``), or unit
        by unit with transformers' ``synced_gpus`` on, so ranks whose sequences end
        early keep serving the others' gathers; ``synced_gpus`` given is kept."""
        generate = getattr(self.module, "generate", None)
        if generate is None:
            raise AttributeError(f"{type(self.module).__name__} has no generate(); sample "
                                 "with a loop of forwards inside model.inference()")
        with self.inference() as whole:
            if whole:
                return generate(*args, **kwargs)
            if self.mesh.control_world > 1 and _takes(generate, "synced_gpus"):
                kwargs.setdefault("synced_gpus", True)
            # a generate that calls an inner model's forward (peft's calls the base
            # model's) passes by the root unit's hooks: its weights (embeddings, head)
            # are held gathered for the call (FSDP2's register_fsdp_forward_method)
            root = next((u for u in self.units if u.module is self.module
                         and u.policy.shards_params), None)
            if root is None:
                return generate(*args, **kwargs)
            root.gather()
            try:
                return generate(*args, **kwargs)
            finally:
                root.release()

    @contextlib.contextmanager
    def inference(self):
        """Forwards of an inference (a generation, an evaluation) the cheapest safe way
        ([Note: generation] in ``cycle.py``): at stage 3 the whole model gathered once
        for the context where ``gathers_whole()`` says so — then ranks may run
        different numbers of forwards —, else unit by unit as in training, which needs
        every rank to run the same forwards. Yields whether the weights are held whole;
        every rank enters it alike."""
        if self.cycle.held or not any(u.policy.shards_params for u in self.units):
            yield True
        elif self.gathers_whole():
            with self.gathered():
                yield True
        else:
            yield False

    def gathers_whole(self) -> bool:
        """Whether inference here holds the full weights at once (``generate_gather``):
        asked, or, for "auto", where every rank's free memory (the device's; the host's
        on CPU) holds the units not yet gathered with a fifth to spare. The ranks agree
        (one small exchange), so all take the same way."""
        how = self.zero_config.generate_gather
        if how != "auto":
            return how == "whole"
        need = sum(u.full_bytes() for u in self.units
                   if u.policy.shards_params and u.state is not UnitState.GATHERED)
        free = free_bytes(self.units[0].device)
        fits = int(free is not None and need * GENERATE_HEADROOM <= free)
        return min(self.comm.agree(fits)()) == 1

    # -- inspection -----------------------------------------------------------------
    def memory(self, optimizer=None, by_placement: bool = False) -> dict:
        """Bytes on this rank per category: params, grads, optimizer (master + state of
        ``optimizer``), padding, and the transient gathered and buffers. With
        ``by_placement``, ``{"device": {...}, "host": {...}, "disk": {...}}``: what
        offload keeps in host memory apart (``ZeroConfig.offload``), and what disk
        offload keeps in files (``ZeroConfig.offload_dir``; the host then holds the
        step's sub-group buffers)."""
        return memory(self, optimizer, by_placement)

    def comm_stats(self, reset: bool = False, by_level: bool = False) -> dict:
        """Per collective kind: calls and bytes this rank sent (ring accounting). With
        ``by_level``, per level first: ``"inside"`` the shard groups, ``"across"`` them
        (hybrid sharding's replica all-reduce), ``"control"`` (the engine's checks)."""
        stats = self.ledger.by_level() if by_level else self.ledger.comm_stats()
        if reset:
            self.ledger.reset()
        return stats

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

    def _grad_ids(self) -> set[int]:
        return {id(s.grad) for _, s in self._named_shards if s.grad is not None}

    def holds_grads(self, ids: set[int]) -> bool:
        """Whether any of the tensor ids ``ids`` is a gradient of this model's shards."""
        return not self._grad_ids().isdisjoint(ids)

    def holds_every_grad(self, ids: set[int]) -> bool:
        """Whether ``ids`` are exactly the gradients this model's shards hold."""
        return ids == self._grad_ids()

    def holds_original(self, ids: set[int]) -> bool:
        """Whether any of ``ids`` is a parameter of the module as it was before
        sharding (an optimizer built before ``zs.shard`` holds those)."""
        return not self._original_ids.isdisjoint(ids)
