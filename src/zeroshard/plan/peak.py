"""The peak per GPU: the largest of the moments a training step passes through.

The plan's ``total`` (persistent state plus activations) is the source documents'
figure. What a GPU must hold is the largest of these moments (each byte term integer),
beside the compute weights and the optimizer state it keeps:

1. **the loss's backward**: every activation of the micro-batch saved
   (``activations.py``; the output layer's and the loss's included), autograd's dense
   gradients of the fp32 logits (``activations.loss_backward_bytes``), and at stage 3
   the root unit gathered (embeddings and head, used last in forward and first in
   backward; ``ModelSpec.root_params``, for Llama-3-8B 1.05 B parameters, 4.2× P / L)
   with the next ``prefetch`` block units arriving;
2. **the block units' backward** (``backward.py``, unit by unit as the engine runs it):
   gradients made as saved tensors are freed, up to three reduction buffers in flight,
   the slots of the landed ones, the head's weight gradient waiting for the embedding's,
   at stage 3 the unit gathered and the next arriving;
3. **the end of backward**: the root unit's gradients made and its reduction issued;
4. **the optimizer step**: the gradients, the step's buffers exactly as the engine's
   ledger holds them in a step pre-hook (``placement.placed_bytes``: stage 1's reduced
   slot in the gradient dtype beside the full gradients, the fp32 copy of the owned
   gradients when the master is fp32 and the gradients are not — DeepSpeed's
   estimator counts the same 4 bytes, its 18P/N at stage 2), and the optimizer's
   temporaries: torch's ``foreach`` AdamW holds ``sqrt(v)`` for every owned element at
   once (``_multi_tensor_adamw``'s ``exp_avg_sq_sqrt``), ``fused`` none, the
   per-parameter loop one parameter's worth.

Gradients are held through backward only when accumulating (the step's first backward
starts after ``zero_grad``): then the stored gradients, and at stage 1 the reduced slot.

With offload (``ZeroConfig.offload``, ``plan/placement.py``) the moments count what stays
on the device: the master, the optimizer state, the fp32 gradient copies and the step's
temporaries move to the host (:attr:`Peak.host`), with ``params`` the weight shards too,
whose device copies join each gather in flight. With the optimizer on disk (the policy's
placement) the device's moments are host offload's; the host holds what
``placed_bytes`` places there (the fp32 gradient copy and the step's sub-group buffers;
the master and the states are in files) and no temporaries: the streamed step runs
torch's fused AdamW kernel on each sub-group (``runtime/offload.py``) whatever
``optimizer_impl`` says.

With hpZ (``ZeroConfig.secondary_group``) every unit keeps its secondary shards (K/K2 of
its weights' slots) from its forward until its backward is done: all of them at the
loss's backward, those of the units not yet done later, none at the step. qwZ's and
qgZ's int8 send and receive buffers (about half a unit's weights or gradients in
flight) are left out.

``profiled`` leaves out what the engine's profiler cannot see (autograd's gradients, a
unit's full gradients at stages 2-3 before they are packed, the optimizer's
temporaries), for holding the plan against a profile. With ``loss_outside`` (the loss
computed on the logits the model returns, as ``zeroshard train --hf-model`` does in
``models/hf.lm_loss``, rather than inside the model's forward as the built-in GPT and
transformers given ``labels`` do) the loss's own saved tensors
(``activations.loss_bytes``: its fp32 log-softmax and the labels) are real memory, in
:attr:`Peak.bytes`, but outside the profiler's saved-tensor hooks, which wrap the
model's forward only, so not in ``profiled``. :attr:`Peak.counted` is ``profiled`` as the
ledger's categories count it, every placement included (the state kept on the host or
on disk, and the host's step buffers at the step).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.config import ZeroConfig
from ..spec.dims import ParallelDims
from ..spec.formulas import ceil_div
from ..spec.policy import ShardPolicy
from ..spec.recipes import Recipe
from .activations import head_bytes, loss_backward_bytes, loss_bytes
from .arch import ModelSpec
from .backward import BackwardPass, Moment
from .comm import secondary_bytes
from .layout import check_layout
from .memory import unit_sizes
from .placement import Placement, model_shapes, owned, place
from .tp import tp_counted, tp_unit_counts, tp_units
from .workload import Workload, activation_saved

#: How the optimizer's temporaries are counted: all owned elements, none, one parameter.
OPTIMIZER_IMPLS = ("foreach", "fused", "for-loop")



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
    """The most saved at once (output layer and loss included): the plan's figure."""
    head_activations: int
    """Of those, the output layer's and the loss's (gone once the head's backward ran)."""
    forward_saved: int
    """Saved at the end of the forward: every block's and the head's."""
    loss_backward: int
    """Autograd's gradients of the fp32 logits while the loss runs backward."""
    root_gathered: int
    """Stage 3 at the loss's backward: the root unit and ``prefetch`` blocks arriving."""
    blocks: Moment
    """The block units' backward at its largest (``backward.py``), beside the held
    state."""
    end: Moment
    """The root unit's backward and reduction at their largest, beside the held state."""
    step_buffers: int
    """At the step: stage 1's reduced slot and the fp32 copies of the owned gradients
    kept on the device (``placement.placed_bytes``)."""
    optimizer_temporaries: int
    """The optimizer's own temporaries at the step."""
    during: int = 0
    """Gradients held through backward: with accumulation the stored ones (and stage
    1's reduced slot), none in the step's first backward."""
    host: int = 0
    """Offload: host bytes per GPU at the step (state, fp32 gradients, temporaries;
    under disk offload the fp32 gradients and the sub-group buffers)."""
    secondary: int = 0
    """hpZ: every unit's secondary shards, held from the forward into the backward."""
    unseen_loss: int = 0
    """Of ``head_activations``, the loss's own saved tensors when it runs outside the
    model's forward, where the profiler does not count them (``loss_outside``)."""
    placement: Placement | None = None
    """Where the training state lives at the step (``placement.placed_bytes``)."""

    @property
    def accumulating(self) -> bool:
        """Gradients are held through backward (more than one micro-batch a step)."""
        return self.during > 0

    @property
    def phases(self) -> dict[str, int]:
        """Bytes at the loss's backward, the block units', the end of backward and the
        optimizer step."""
        held = self.weights + self.optimizer + self.during
        return {
            "loss backward": held + self.forward_saved + self.loss_backward
            + self.root_gathered + self.secondary,
            "block backward": held + self.blocks.bytes,
            "backward end": held + self.end.bytes,
            "optimizer step": self.weights + self.optimizer + self.grads + self.step_buffers
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
    def seen_phases(self) -> dict[str, int]:
        """:attr:`phases` as the engine's profiler sees them: without autograd's
        gradients, the full gradients its ledger does not count and the optimizer's
        temporaries."""
        held = self.weights + self.optimizer + self.during
        return {
            "loss backward": held + self.forward_saved - self.unseen_loss + self.root_gathered
            + self.secondary,
            "block backward": held + self.blocks.seen,
            "backward end": held + self.end.seen,
            "optimizer step": self.weights + self.optimizer + self.grads + self.step_buffers,
        }

    @property
    def profiled(self) -> int:
        """The peak as the engine's profiler sees it (:attr:`seen_phases`)."""
        return max(self.seen_phases.values())

    @property
    def profiled_moment(self) -> str:
        """Which moment :attr:`profiled` is; inside backward, which unit's."""
        phases = self.seen_phases
        name = max(phases, key=phases.get)
        inside = {"block backward": self.blocks.seen_at, "backward end": self.end.seen_at}
        return f"{name} ({inside[name]})" if name in inside else name

    @property
    def off_device(self) -> int:
        """State held off the device at every moment: the host's weight shards, the
        host's or the disk's master and optimizer state."""
        if self.placement is None:
            return 0
        p = self.placement
        return p.host.weights + p.host.optimizer + p.disk.optimizer

    @property
    def counted(self) -> int:
        """:attr:`profiled` as the engine's ledger counts it: its categories hold every
        placement, so the state kept off the device at every moment, and the host's
        step buffers (the fp32 gradient copies, disk offload's sub-groups) at the step."""
        step = self.placement.host.buffers if self.placement is not None else 0
        phases = self.seen_phases
        phases["optimizer step"] += step
        return max(phases.values()) + self.off_device

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in (
            "weights", "grads", "optimizer", "activations", "head_activations",
            "forward_saved", "loss_backward", "root_gathered", "step_buffers",
            "optimizer_temporaries", "during", "accumulating", "host", "secondary",
            "unseen_loss")}
        for name in ("blocks", "end"):
            m = getattr(self, name)
            out[name] = {"bytes": m.bytes, "at": m.at, "seen": m.seen, "seen_at": m.seen_at}
        return {**out, "phases": self.phases, "peak": self.bytes, "moment": self.moment}


def unit_params(model: ModelSpec, blocks_per_unit: int, tp: int = 1) -> tuple[int, int]:
    """(root unit, largest block unit) parameters on one GPU of ``tp`` (``tp.py``)."""
    return tp_units(model, tp, blocks_per_unit)


def peak(model: ModelSpec, dims: ParallelDims, config: ZeroConfig, work: Workload,
         blocks_per_unit: int = 1, micro_batches: int = 1, optimizer_impl: str = "foreach",
         loss_outside: bool = False) -> Peak:
    """The :class:`Peak` of one GPU of the layout ``dims`` running ``config`` (its stage,
    recipe, prefetch, offload and its placement, hpZ's secondary shards), with
    ``micro_batches`` micro-batches of ``work`` per step in units of ``blocks_per_unit``
    blocks; every shard, reduction buffer and owned slice is that of the shard group's K
    ranks (under hybrid sharding the replicas' all-reduce runs in place on the reduced
    slot: nothing more is held); ``loss_outside``: the loss runs outside the model's
    forward (:attr:`Peak.unseen_loss`)."""
    if optimizer_impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"optimizer_impl={optimizer_impl!r}; expected one of "
                         f"{', '.join(OPTIMIZER_IMPLS)}")
    check_layout(dims, config)
    policy, recipe, tp, k = config.policy, config.recipe, dims.tp, dims.shard_size
    params = tp_counted(model, tp)  # the split ones and, on every tp GPU, the whole
    placed = place(params, dims, config,
                          shapes=model_shapes(model) if config.recipe.shaped_state else None)
    device = placed.device
    saved = activation_saved(model, recipe, work, tp)
    acts = saved.peak if saved else 0
    head = loss = unseen = 0
    if model.arch is not None and acts:
        head = work.tokens * head_bytes(model.arch, recipe.activation_bytes, work.cpu)
        loss = work.tokens * loss_backward_bytes(model.arch)
        unseen = work.tokens * loss_bytes(model.arch) if loss_outside else 0
    root, block = unit_params(model, blocks_per_unit, tp)
    prefetch = config.prefetch if policy.shards_params else 0  # whole weights: no gathers
    params_on_host = policy.where("params") == "host"
    gathered = 0
    if policy.shards_params:  # the root unit gathered, the next prefetch blocks arriving
        gathered = (root + prefetch * block) * recipe.weight_bytes
        if params_on_host:  # each gather's input copied up from the host first
            gathered += ceil_div(root + prefetch * block, k) * recipe.weight_bytes
    mine = owned(params, dims, policy)
    state = recipe.optimizer_bytes - recipe.master_bytes  # bytes per element of the moments
    per_state = state // recipe.optimizer_states if recipe.optimizer_states else 0
    largest = ceil_div(max(root, block), k if policy.shards_optimizer else 1)
    temporaries = {"foreach": mine * per_state, "fused": 0,
                   "for-loop": largest * per_state}[optimizer_impl]
    offloaded = policy.offloads_optimizer
    streamed = policy.optimizer_on_disk  # the fused kernel on each sub-group: none
    host = placed.host.total + (0 if streamed else temporaries) if offloaded else 0
    if offloaded:  # the step's temporaries are the host's
        temporaries = 0
    during = 0
    if micro_batches > 1:  # stage 1's reduced slot lives from one backward to the next
        during = device.grads + (mine * recipe.grad_bytes if policy.keeps_local_grads else 0)
    kept = secondary_bytes(params, dims, config,
                           tp_unit_counts(model, tp, unit_sizes(model, blocks_per_unit)))
    walk = _backward(model, policy, recipe, saved, k, prefetch, blocks_per_unit, tp,
                     micro_batches > 1, params_on_host, kept)
    forward_saved = saved.blocks + saved.head if saved else 0
    return Peak(device.weights, device.grads, device.optimizer, acts, head, forward_saved,
                loss, gathered, walk.blocks_moment(), walk.end_moment(), device.buffers,
                temporaries, during, host, sum(kept), unseen, placed)


def _backward(model: ModelSpec, policy: ShardPolicy, recipe: Recipe, saved, k: int,
              prefetch: int, blocks_per_unit: int, tp: int, accumulating: bool,
              params_offloaded: bool, kept: list[int]) -> BackwardPass:
    """The :class:`BackwardPass` of this model and workload: units of
    ``blocks_per_unit`` blocks, each block unit's share of the saved bytes (every block
    alike), a bare count's units all block units (no root, no head)."""
    layers = model.layers or 1
    per_unit = min(max(1, blocks_per_unit), layers)
    units = ceil_div(layers, per_unit)
    arch = model.arch
    root, unit = tp_units(model, tp, per_unit)
    root = root if arch else 0
    head = (arch.vocab * arch.hidden if arch.family == "gpt" else  # whole under its plan
            ceil_div(arch.vocab * arch.hidden, tp)) if arch else 0
    norm = arch.hidden * (2 if arch.norm_bias else 1) if arch else 0
    block_saved = ceil_div(saved.blocks * per_unit, layers) if saved else 0
    secondary_root = kept[0] if kept and arch else 0
    secondary_unit = max(kept[1:] if arch else kept, default=0)
    return BackwardPass(policy, k, recipe, units, unit, root, head, bool(arch and arch.tied),
                        norm, block_saved, saved.recompute if saved else 0,
                        saved.kept if saved else 0, prefetch, accumulating,
                        params_offloaded, secondary_root, secondary_unit)
