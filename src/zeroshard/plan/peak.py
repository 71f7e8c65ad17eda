"""The peak per GPU: the largest of the moments a training step passes through.

The plan's ``total`` (persistent state plus activations) is the source documents'
figure. What a GPU must hold is the largest of these moments (each byte term integer):

1. **the loss's backward**: persistent state (gradients only when accumulating: the
   step's first backward starts after ``zero_grad``), every activation of the
   micro-batch saved (``activations.py``; the output layer's and the loss's included),
   autograd's dense gradients of the fp32 logits (``activations.loss_backward_bytes``),
   and at stage 3 the root unit gathered (embeddings and head, used last in forward and
   first in backward) with the next ``prefetch`` blocks arriving;
2. **the backward of a unit**: gradients grow as activations are freed, so the
   largest is at one end — right after the root unit's backward (its gradients, every
   block's activations, its transients, ``memory.transient_bytes``: gathered weights,
   full gradients, reduction buffers; the root unit is ``ModelSpec.root_params``, for
   Llama-3-8B 1.05 B parameters, 4.2× P / L) or at the end of backward (every
   gradient, the last block unit's transients);
3. **the optimizer step**: persistent state, the fp32 copy of the owned gradients when
   the master is fp32 and the gradients are not (the engine's ``step_grads``;
   DeepSpeed's estimator counts the same 4 bytes, its 18P/N at stage 2), and the
   optimizer's temporaries: torch's ``foreach`` AdamW holds ``sqrt(v)`` for every owned
   element at once (``_multi_tensor_adamw``'s ``exp_avg_sq_sqrt``), ``fused`` none,
   the per-parameter loop one parameter's worth.

With ``offload`` (``plan/offload.py``) the moments count what stays on the device: the
master, the optimizer state, the fp32 gradient copies and the step's temporaries move to
the host (:attr:`Peak.host`), with ``params`` the weight shards too, whose device copies
join each gather in flight.

With hpZ (``zeropp``, :class:`~zeroshard.plan.comm.ZeroPP`) every unit keeps its
secondary shards (K/K2 of its weights' slots) from its forward until its backward is
done: all of them at the loss's backward and through the root unit's backward, the last
block unit's at the end of backward, none at the step. qwZ's and qgZ's int8 send and
receive buffers (about half a unit's weights or gradients in flight) are left out.

``profiled`` leaves out what the engine's profiler cannot see (autograd's gradients
and the optimizer's temporaries), for holding the plan against a profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from .activations import head_bytes, loss_backward_bytes
from .arch import ModelSpec
from .memory import (
    Workload,
    ZeroPP,
    activation_bytes,
    secondary_bytes,
    shard_degree,
    transient_bytes,
    unit_sizes,
)
from .offload import offload_at, placed_bytes
from .recipes import Recipe

#: How the optimizer's temporaries are counted: all owned elements, none, one parameter.
OPTIMIZER_IMPLS = ("foreach", "fused", "for-loop")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Peak:
    """Bytes per GPU at each moment of a step; :attr:`bytes` is the largest."""

    weights: int
    """Compute weights held (the plan's ``weights``)."""
    grads: int
    """Gradients held after backward (the plan's ``grads``)."""
    optimizer: int
    """Master and optimizer state (the plan's ``optimizer``)."""
    activations: int
    """Saved tensors at the start of backward (output layer and loss included)."""
    head_activations: int
    """Of those, the output layer's and the loss's (gone once the head's backward ran)."""
    loss_backward: int
    """Autograd's gradients of the fp32 logits while the loss runs backward."""
    root_gathered: int
    """Stage 3 at the loss's backward: the root unit and ``prefetch`` blocks arriving."""
    root_transients: int
    """The root unit's backward transients (``memory.transient_bytes``)."""
    root_grads: int
    """The root unit's share of the gradients, held once its backward is done."""
    unit_transients: int
    """The last block unit's backward transients, when every gradient is held."""
    step_grads: int
    """fp32 copies of the owned gradients at the optimizer step."""
    optimizer_temporaries: int
    """The optimizer's own temporaries at the step."""
    accumulating: bool = False
    """More than one micro-batch per step: gradients are held during backward."""
    host: int = 0
    """Offload: host bytes per GPU at the step (state, fp32 gradients, temporaries)."""
    secondary: int = 0
    """hpZ: every unit's secondary shards, held from the forward into the backward."""
    unit_secondary: int = 0
    """hpZ: the last block unit's secondary shards, held through its backward."""

    @property
    def phases(self) -> dict[str, int]:
        """Bytes at the loss's backward, a unit's backward and the optimizer step."""
        held = self.weights + self.optimizer
        during = self.grads if self.accumulating else 0
        return {
            "loss backward": held + during + self.activations + self.loss_backward
            + self.root_gathered + self.secondary,
            "unit backward": held + during + self.root_grads + self.activations
            - self.head_activations + self.root_transients + self.secondary,
            "backward end": held + self.grads + self.unit_transients + self.unit_secondary,
            "optimizer step": held + self.grads + self.step_grads
            + self.optimizer_temporaries,
        }

    @property
    def bytes(self) -> int:
        """The peak: the largest moment."""
        return max(self.phases.values())

    @property
    def moment(self) -> str:
        """Which moment the peak is."""
        phases = self.phases
        return max(phases, key=phases.get)

    @property
    def profiled(self) -> int:
        """The peak as the engine's profiler sees it: without autograd's gradients and
        the optimizer's temporaries."""
        held = self.weights + self.optimizer
        during = self.grads if self.accumulating else 0
        phases = self.phases
        return max(held + during + self.activations + self.root_gathered + self.secondary,
                   phases["unit backward"], phases["backward end"],
                   held + self.grads + self.step_grads)

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in (
            "weights", "grads", "optimizer", "activations", "head_activations",
            "loss_backward", "root_gathered", "root_transients", "root_grads",
            "unit_transients", "step_grads",
            "optimizer_temporaries", "accumulating", "host", "secondary", "unit_secondary")}
        return {**out, "phases": self.phases, "peak": self.bytes, "moment": self.moment}


def unit_params(model: ModelSpec, blocks_per_unit: int, tp: int = 1) -> tuple[int, int]:
    """(root unit, largest block unit) parameters on one GPU of ``tp``."""
    if model.layers is None:
        return _ceil_div(model.params, tp), _ceil_div(model.params, tp)
    blocks = min(blocks_per_unit, model.layers)
    return (_ceil_div(model.root_params, tp), _ceil_div(blocks * model.block_params, tp))


def peak(model: ModelSpec, recipe: Recipe, work: Workload, gpus: int, stage: int,
         prefetch: int = 1, blocks_per_unit: int = 1, tp: int = 1, micro_batches: int = 1,
         optimizer_impl: str = "foreach", shard_group: int | None = None,
         offload: str | None = None, zeropp: ZeroPP | None = None) -> Peak:
    """The :class:`Peak` of one GPU of ``gpus`` at ``stage`` running ``micro_batches``
    micro-batches of ``work`` per step; with ``shard_group`` K (hybrid sharding) every
    shard, reduction buffer and owned slice is that of K ranks (the replicas'
    all-reduce runs in place on the reduced slot: nothing more is held); ``offload`` as
    far as ``stage`` takes it (``offload.offload_at``); ``zeropp`` as far as ``stage``
    takes it (``ZeroPP.at``): hpZ's secondary shards."""
    if optimizer_impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"optimizer_impl={optimizer_impl!r}; expected one of "
                         f"{', '.join(OPTIMIZER_IMPLS)}")
    dp = shard_degree(gpus, tp, shard_group)  # the ranks each category is sharded over
    offload = offload_at(stage, offload)
    placed = placed_bytes(model.params, gpus, recipe, stage, offload, tp, shard_group)
    weights, grads, optimizer = (placed.device.weights, placed.device.grads,
                                 placed.device.optimizer)
    acts = activation_bytes(model, recipe, work, tp) or 0
    head = 0
    loss = 0
    if model.arch is not None and acts:
        head = work.tokens * head_bytes(model.arch, recipe.activation_bytes)
        loss = work.tokens * loss_backward_bytes(model.arch)
        if work.checkpointing:  # the recomputed block comes after the head's backward
            head = min(head, acts - work.tokens * recipe.activation_bytes * model.hidden
                       * model.layers)
    root, block = unit_params(model, blocks_per_unit, tp)
    gathered = 0
    if stage == 3:
        gathered = (root + prefetch * block) * recipe.weight_bytes
        if offload == "params":  # each gather's input copied up from the host first
            gathered += _ceil_div(root + prefetch * block, dp) * recipe.weight_bytes
    root_transients = sum(transient_bytes(recipe, stage, dp, root, prefetch).values())
    transients = sum(transient_bytes(recipe, stage, dp, block, prefetch).values())
    root_grads = grads * root // max(1, _ceil_div(model.params, tp))
    owned = _ceil_div(model.params, tp) if stage == 0 else _ceil_div(model.params, tp * dp)
    step_grads = owned * recipe.master_bytes if (
        recipe.master_bytes and recipe.master_dtype != recipe.grad_dtype) else 0
    state = recipe.optimizer_bytes - recipe.master_bytes  # bytes per element of the moments
    per_state = state // recipe.optimizer_states if recipe.optimizer_states else 0
    largest = max(root, block) if stage == 0 else _ceil_div(max(root, block), dp)
    temporaries = {"foreach": owned * per_state, "fused": 0,
                   "for-loop": largest * per_state}[optimizer_impl]
    if offload:  # the fp32 gradients and the step's temporaries are the host's
        host, step_grads, temporaries = placed.host.total + temporaries, 0, 0
    else:
        host = 0
    kept = secondary_bytes(model.params, gpus, recipe, stage, shard_group, tp,
                           zeropp and zeropp.at(stage), unit_sizes(model, blocks_per_unit))
    return Peak(weights, grads, optimizer, acts, head, loss, gathered, root_transients,
                root_grads, transients, step_grads, temporaries, micro_batches > 1, host,
                sum(kept), max(kept[1:] or kept or [0]))
