"""The hooks that drive a sharded model's passes ([Note: the step cycle] in
``cycle.py``): before and after the whole module's forward, before and after each
unit's, when backward reaches a unit's outputs, when a trainable parameter's gradient
has accumulated, and when backward begins and ends. Each hook asks the unit, the
prefetcher, the reducer, the cycle or the stepper to act; it keeps no state of its
own: where the model is, ``gathered()``'s hold included, is the step cycle's.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .build import broadcast_buffers
from .cycle import CycleState
from .unit import Unit


def _recomputing() -> bool:
    """Inside backward: activation checkpointing recomputes a forward there."""
    return torch._C._current_graph_task_id() != -1


def _needing_grad(out) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if torch.is_tensor(t) and t.requires_grad]


class PassHooks:
    """Forward and backward hooks of one sharded model."""

    def __init__(self, model) -> None:
        self.model = model
        self.handles = []  # the module hooks (a copy of the module drops them: adapters.py)
        # the root's hooks run first and last: every forward of the module, through the
        # model or through a method of the module itself (generate), is prepared alike
        self.handles.append(model.module.register_forward_pre_hook(
            _eager(self._root_pre_forward), with_kwargs=True, prepend=True))
        self.handles.append(model.module.register_forward_hook(
            _eager(self._root_post_forward), with_kwargs=True))
        owner, handles = weakref.ref(model), []
        weakref.finalize(model, _remove_hooks, handles)
        for k, u in enumerate(model.units):
            # A tensor's hooks are held from C++, where the cycle collector cannot see
            # them: a hook holding the engine or a unit would keep both (and their
            # process groups) alive for the life of the interpreter. So they hold it
            # weakly, and go with it.
            for i in u.trainable:
                handles.append(u.params[i].register_post_accumulate_grad_hook(
                    functools.partial(_grad_hook, owner, k)))
            if u.policy.shards_params and len(u.trainable) < len(u.params):
                # frozen weights: released once its inputs' gradients are done too, or
                # when backward ends if its module calls other units (unit.py)
                inside = set(u.module.modules())
                if any(v.module is not u.module and v.module in inside for v in model.units):
                    u.progress.hold_to_the_end()
                self.handles.append(u.module.register_forward_pre_hook(_eager(
                    functools.partial(self._pre_forward_counted, owner, k)), with_kwargs=True))
            else:
                self.handles.append(u.module.register_forward_pre_hook(
                    _eager(lambda m, a, u=u: self._pre_forward(u))))
            self.handles.append(u.module.register_forward_hook(
                _eager(lambda m, a, out, u=u: self._post_forward(u, out))))
            if u.module._compiled_call_impl is None:
                u.module._compiled_call_impl = _border(u.module)

    def _root_pre_forward(self, module, args, kwargs):
        if _recomputing():
            return None
        m = self.model
        m.stepper.settle()  # shards no optimizer stepped since the last backward
        m.cycle.forward_begins()
        if m.tp_counter is not None:  # on until the step ([Note: counting tensor-parallel
            m.tp_counter.start()      # collectives] in collectives.py)
        for u in m.units:
            u.wait_sync()
        if torch.is_grad_enabled() and m.cycle.state is CycleState.FINAL:
            for u in m.units:  # another micro-batch: its backward makes them anew
                u.drop_step_grads()
        if m.zero_config.broadcast_buffers and torch.is_grad_enabled() and m.reducer.sync:
            broadcast_buffers(module, m.comm)  # as torch DDP, before every forward
        dtype = m.units[0].compute_dtype
        if dtype == torch.float32:
            return None
        # inputs follow the compute dtype (FSDP2: cast_forward_inputs)
        cast = lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
        return tree_map(cast, args), tree_map(cast, kwargs)

    def _root_post_forward(self, module, args, kwargs, out):
        if _recomputing():
            return
        self.model.prefetcher.end_pass("forward")
        tensors = _needing_grad(out)
        if not tensors and self.model.tp_counter is not None:
            self.model.tp_counter.stop()  # no backward follows
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads: self._on_backward_begin(), mode="any")

    def _pre_forward(self, unit: Unit) -> None:
        unit.events.emit("forward_begin", unit)
        if not unit.policy.shards_params or self.model.cycle.held:
            return
        if _recomputing():
            unit.gather()  # activation checkpointing's recompute: not a forward pass
        else:
            self.model.prefetcher.use(unit, "forward")

    def _pre_forward_counted(self, owner, k: int, module, args, kwargs):
        """A unit with frozen parameters: gathered as any, and its inputs that need a
        gradient pass through :class:`_InputGrads`, which tells the unit when their
        gradients are computed ([Note: partly frozen units] in ``unit.py``)."""
        unit = self.model.units[k]
        self._pre_forward(unit)
        if not torch.is_grad_enabled() or _recomputing():
            return None  # a recompute's graph is not the one backward runs
        flat, spec = tree_flatten((args, kwargs))
        where = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
        if not where:
            return None
        unit.progress.forward_call()
        passed = _InputGrads.apply(functools.partial(_inputs_hook, owner, k),
                                   *[flat[i] for i in where])
        for i, t in zip(where, passed):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _post_forward(self, unit: Unit, out) -> None:
        unit.events.emit("forward_end", unit)
        if not unit.policy.shards_params or self.model.cycle.held or _recomputing():
            return  # activation checkpointing recomputes inside backward: keep it gathered
        unit.release(keep_secondary=torch.is_grad_enabled())  # hpZ: for its backward
        tensors = _needing_grad(out)
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads: self._pre_backward(unit), mode="any")

    def _pre_backward(self, unit: Unit) -> None:
        unit.events.emit("backward_begin", unit)
        self.model.prefetcher.use(unit, "backward")

    def _on_backward_begin(self) -> None:
        m = self.model
        if m.cycle.state is CycleState.BACKWARD:
            return  # another output of the same backward
        if self.model.cycle.held:
            raise ValueError("a backward pass began inside model.gathered(), which holds "
                             "the full weights for inference: train outside it")
        new_cycle = m.cycle.new_cycle
        m.cycle.advance("backward_begin")
        m.stepper.backward_begins()
        m.reducer.begin(new_cycle)
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        m = self.model
        m.reducer.end()
        m.prefetcher.end_pass("backward")
        m.cycle.advance("backward_end" if m.reducer.sync else "backward_end_unreduced")
        if m.reducer.sync:  # shards hold their reduced .grad once backward ends (FSDP2)
            m.stepper.finalize_grads()


class _InputGrads(torch.autograd.Function):
    """The identity on a unit's inputs, whose backward runs once their gradients are
    computed: after every node of the call that reads the unit's weights for them
    (FSDP2's ``RegisterPostBackwardFunction``)."""

    @staticmethod
    def forward(ctx, hook, *inputs):
        ctx.hook = hook
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook()
        return (None, *grads)


def _inputs_hook(owner: weakref.ref, k: int) -> None:
    model = owner()
    if model is not None:
        model.units[k].inputs_done()


def _eager(hook):
    """``hook``, run outside any compiled graph: under ``torch.compile`` the hooks'
    collectives, storage resizes and bookkeeping stay eager, and a unit's call is a graph
    border (FSDP2's ``_dynamo_disable`` of its hooks, ``fsdp/_fully_shard/_fsdp_common.py``;
    the unit's forward is then compiled as a frame of its own)."""
    import torch._dynamo

    return torch._dynamo.disable(hook, recursive=True,
                                 reason="zeroshard's hooks gather, release and reduce")


def _border(module):
    """``module``'s call as one graph border: a compiled caller does not trace into it
    (one break, not one per hook), while the module's own forward, called from it, is
    compiled as a frame of its own (``recursive=False``)."""
    import torch._dynamo

    return torch._dynamo.disable(module._call_impl, recursive=False,
                                 reason="a zeroshard unit: its hooks run eagerly")


def _remove_hooks(handles: list) -> None:
    for h in handles:
        h.remove()


def _grad_hook(owner: weakref.ref, k: int, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a trainable parameter of ``owner().units[k]``."""
    model = owner()
    if model is not None:
        model.reducer.on_grad(model.units[k])
