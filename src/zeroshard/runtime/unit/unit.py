"""A unit: the parameters gathered together and reduced together. One code path for
every stage; what differs is asked of its :class:`~zeroshard.spec.policy.ShardPolicy`
(stage 0 is a shard group of one for the optimizer state). Others read a unit through
the public methods of :class:`UnitView` (``unit/view.py``)."""

from __future__ import annotations

import torch
import torch.nn as nn

from ...offload.disk import place_on_disk
from ...spec.policy import FullGrads, ShardPolicy
from ..comm.collectives import Collectives
from ..dist import TORCH_DTYPES, host_device
from ..events import Events
from .layout import ShardLayout
from .step import UnitStep
from .view import UnitState, UnitView


class Unit(UnitStep, UnitView):
    """Shards, gradients and collectives of one group of parameters."""

    def __init__(self, index: int, module: nn.Module, named_params: list[tuple[str, nn.Parameter]],
                 policy: ShardPolicy, recipe, comm: Collectives, device: torch.device,
                 events: Events):
        self.index, self.module, self.policy, self.comm = index, module, policy, comm
        self.events = events
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        # rank and world of the optimizer state's shard group (a group of one at stage 0)
        self.rank, self.world = policy.shard_coords(comm.shard_rank, comm.shard_world)
        self.w_layout = ShardLayout([tuple(p.shape) for p in self.params], self.world)
        self.g_layout = ShardLayout([tuple(self.params[i].shape) for i in self.trainable],
                                    self.world)
        # Gradients always travel in the K-slot layout of the shard group, stage 0
        # included: on gloo a reduce-scatter is an all-reduce of its input
        # (collectives.py), so stage 0's all-reduce of the same buffer sums every element
        # in the same order, and stage 0 matches stages 1-3 bit for bit.
        self.r_layout = ShardLayout([s.shape for s in self.g_layout.slots], comm.shard_world)
        self.compute_dtype = TORCH_DTYPES[recipe.param_dtype]
        self.grad_dtype = TORCH_DTYPES[recipe.grad_dtype]
        self.reduce_dtype = TORCH_DTYPES[recipe.reduce_dtype or recipe.grad_dtype]
        self.master_dtype = TORCH_DTYPES[recipe.master_dtype] if recipe.master_dtype else None
        if policy.offloads_optimizer and self.master_dtype is None:
            self.master_dtype = torch.float32  # fp32 offloaded: the host copy the step updates
        self.device = device
        self.host = host_device()

        # Parameter by parameter, so a rank holds the unit once plus one parameter: copy
        # into a padded storage, take this rank's master rows, drop the original.
        self.padded = []  # full parameters' storages, [world, c·row] each
        self.master = None  # 1D [S_g]: this rank's slot of fp32 master weights
        if self.master_dtype is not None:
            self.master = torch.zeros(self.g_layout.slot_numel, dtype=self.master_dtype,
                                      device=self.host if policy.offloads_optimizer else device,
                                      pin_memory=policy.where("optimizer") == "host"
                                      and _pinned())
        g_slot = {i: self.g_layout.slots[j] for j, i in enumerate(self.trainable)}
        for i, (slot, p) in enumerate(zip(self.w_layout.slots, self.params)):
            src = p.detach().to(device).reshape(slot.rows, slot.row_numel)
            if (src.dtype == self.compute_dtype and src.is_contiguous()
                    and src.storage_offset() == 0 and slot.chunk_rows * self.world == slot.rows
                    and src.untyped_storage().nbytes() == slot.numel * src.element_size()
                    and src.untyped_storage().resizable()):
                # no padding: keep the storage, under a tensor with its own version counter
                # (autograd must not see the optimizer's in-place updates as edits of p).
                # Not one that cannot be resized (weights memory-mapped from a file, as
                # transformers' from_pretrained leaves them): release() empties it.
                buf = torch.empty(0, dtype=src.dtype, device=device).set_(
                    src.untyped_storage(), 0, (self.world, slot.chunk_numel))
            else:
                buf = self.w_layout.padded_empty(slot, self.compute_dtype, device)
                buf.view(-1)[:slot.numel].copy_(src.reshape(-1))
                buf.view(-1)[slot.numel:].zero_()
            flat = buf.view(-1)
            if self.master is not None and i in g_slot:
                gs, real = g_slot[i], g_slot[i].real_rows(self.rank)
                first = self.rank * gs.chunk_rows
                self.master[gs.offset:gs.offset + real * gs.row_numel].copy_(
                    src[first:first + real].reshape(-1))
            p.data = flat[:slot.numel].view(slot.shape)
            self.padded.append(buf)
            del src
        self.disk = None  # disk offload: the file of the master and moments (offload/disk.py)
        if policy.optimizer_on_disk and self.master is not None:
            self.disk, self.master = place_on_disk(self.master, policy.offload_dir, comm, index)
        self.w_shard = None  # 1D [S_w], sharded parameters: this rank's slot of compute weights
        if policy.shards_params:
            self.w_shard = torch.cat([buf[self.rank] for buf in self.padded])
            if policy.where("params") == "host":  # copied to the device by each gather
                self.w_shard = self.w_shard.to(self.host)
                if _pinned():
                    self.w_shard = self.w_shard.pin_memory()
        # 1D [S_g], reduce-scattered gradients: this cycle's reduced gradients (accumulated over its
        # backwards at stages 2-3); made by the cycle's first reduction, dropped after the step
        self.grad_shard = None
        self.shards = self._make_shards()
        self.state = UnitState.GATHERED
        self.pending_grads = 0  # trainable parameters yet to accumulate in this backward
        self.ready = False  # this backward is done with the unit's parameters
        self.fresh = True  # the next reduced gradient overwrites the accumulator
        self.presence = None  # [F] per trainable param: ranks x micro-batches with a gradient
        self._in_flight = None  # (work, buffers...) of an issued reduction
        self._sync_work = None  # all-gather of updated weights after a step
        self._gather_work = None  # sharded parameters: (work, [N, S] buffer) of a gather
        self.w_secondary = None  # hpZ: [K/K2, S] slots kept from forward for backward
        self.host_grads = None  # offload: the reduced slot copied to the host (master dtype)
        self.prefetched = False  # gathered ahead of use, not used yet
        self.name = ""  # the unit's module, as the model names it (set by the engine)
        self.step_grads = None  # 1D fp32 gradients handed to the optimizer (transient)
        if policy.shards_params:
            self.release()

    # -- construction ---------------------------------------------------------------
    def _make_shards(self) -> list[nn.Parameter]:
        """The parameters the optimizer sees: views of this rank's rows, shaped
        ``[real_rows, *shape[1:]]``, of the master (mixed precision) or of the compute
        weights themselves (fp32: the weights are the master)."""
        w_views = (self.w_layout.shard_views(self.w_shard, self.rank) if self.w_shard is not None
                   else
                   [buf[self.rank][:s.real_rows(self.rank) * s.row_numel].view(
                       s.shard_shape(self.rank)) for buf, s in zip(self.padded,
                                                                   self.w_layout.slots)])
        views = list(w_views)
        if self.master is not None:
            for j, view in enumerate(self.g_layout.shard_views(self.master, self.rank)):
                views[self.trainable[j]] = view
        return [nn.Parameter(v, requires_grad=p.requires_grad)
                for v, p in zip(views, self.params)]

    # -- sharded parameters (stage 3): gather and release ---------------------------
    def start_gather(self) -> None:
        """Issue the all-gather of the compute weights (a prefetch returns here)."""
        if self.state is not UnitState.SHARDED:
            return
        out = torch.empty(self.world, self.w_layout.slot_numel, dtype=self.compute_dtype,
                          device=self.device)
        if self.w_secondary is not None and torch._C._current_graph_task_id() != -1:
            # hpZ, in backward: inside the secondary group only (a forward always gathers
            # the shards: a secondary copy left by a forward no backward used is stale
            # once the weights change)
            work = self.comm.all_gather(out, self.w_secondary, async_op=True, unit=self.index,
                                        secondary=True)
        else:
            work = self.comm.all_gather(out, self.w_shard.to(self.device, non_blocking=True),
                                        async_op=True, unit=self.index, weights=True)
        self._gather_work = (work, out)
        self.state = UnitState.GATHERING
        self.events.emit("gather_issued", self)

    def gather(self) -> None:
        """Finish (or issue and finish) the all-gather into the full parameters' storages."""
        self.prefetched = False  # in use now
        if self.state is UnitState.GATHERED:
            return
        self.start_gather()
        work, out = self._gather_work
        work.wait()
        self._gather_work = None
        for p, buf in zip(self.params, self.padded):
            p.untyped_storage().resize_(buf.numel() * buf.element_size())
        self.w_layout.unpack_into(out, self.padded)
        self.state = UnitState.GATHERED
        self.events.emit("gather_done", self)

    def release(self, keep_secondary: bool = False) -> None:
        """Free the full parameters; autograd's saved references keep the (empty)
        storage object, which :meth:`gather` refills before backward needs it.

        hpZ, after a forward (``keep_secondary``): secondary rank j of K2 keeps the slots
        of shard ranks [j·m, (j+1)·m), m = K / K2 — the K2 ranks of its secondary group
        hold all K between them — so the backward's gather stays inside that group."""
        if self.state is UnitState.GATHERING:  # a prefetch nobody used: let it land
            self.gather()
        self.w_secondary = None
        if keep_secondary and self.comm.secondary_world and self.state is UnitState.GATHERED:
            m = self.world // self.comm.secondary_world
            j = self.comm.secondary_rank
            self.w_secondary = torch.cat([buf[j * m:(j + 1) * m] for buf in self.padded],
                                         dim=1)  # [m, S], the gather's slot layout
        for p in self.params:
            p.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED
        self.events.emit("release", self)

    # -- gradients ------------------------------------------------------------------
    def start_backward(self, new_cycle: bool) -> None:
        self.pending_grads = len(self.trainable)
        self.ready = False
        if new_cycle:
            self.fresh = True
            self.host_grads = None
            self.presence = None
            self.step_grads = None
            if self.policy.keeps_full_grads:  # the last cycle's, still held
                for i in self.trainable:
                    self.params[i].grad = None

    def local_grads(self):
        """Full local gradients as [rows, row] views (zeros where none) and [F] flags."""
        grads, flags = [], []
        for j, i in enumerate(self.trainable):
            g, slot = self.params[i].grad, self.g_layout.slots[j]
            flags.append(g is not None)
            grads.append(torch.zeros(slot.rows, slot.row_numel, dtype=self.grad_dtype,
                                     device=self.device) if g is None
                         else g.reshape(slot.rows, slot.row_numel))
        return grads, torch.tensor(flags, dtype=self.grad_dtype, device=self.device)

    def reduction_issued(self, work, buf: torch.Tensor, part: torch.Tensor) -> None:
        """This unit's gradients are packed into ``buf``; ``part`` of the result is its
        share. The local full gradients go now where the policy frees them."""
        self._in_flight = (work, buf, part)
        if self.policy.frees_grads_when_packed:
            for i in self.trainable:
                self.params[i].grad = None
        self.events.emit("reduce_issued", self)

    def advance_reduce(self) -> None:
        """Hybrid sharding: land the reduction inside the shard group and issue the one
        across replica groups, not waiting for it (it overlaps what follows); the
        reduce-scatter's input buffer goes now. Otherwise, :meth:`wait_reduce`."""
        if self._in_flight is None or not hasattr(self._in_flight[0], "advance"):
            self.wait_reduce()
            return
        work, part = self._in_flight[0], self._in_flight[-1]
        work.advance()
        if self.policy.reduce == "reduce_scatter":  # the across reduces ``part`` only
            self._in_flight = (work, part)

    def wait_reduce(self) -> None:
        """Finish an issued reduction: average, then store where the stage keeps it."""
        if self._in_flight is None:
            return
        work, out = self._in_flight[0], self._in_flight[-1]
        work.wait()
        self._in_flight = None
        self.events.emit("reduce_done", self)
        S = self.r_layout.slot_numel
        full = self.policy.full_grads
        if full is FullGrads.AVERAGED:  # [K, S + F]: every slot, averaged into full grads
            flags = out[0, S:]  # summed over every rank: > 0 where any rank saw it
            self._land_full_grads(out[:, :S], (flags > 0).tolist())
        else:  # [S + F]: this rank's slot, already averaged by the reduce-scatter
            flags, reduced = out[S:], out[:S]
            if full is FullGrads.LOCAL or self.fresh:
                # A view of the reduction's result when the dtypes agree (no copy, and no
                # shard of gradients held between steps), else rounded into the stored
                # dtype. Kept local sums are reduced again whole: the last counts.
                self.grad_shard = reduced.to(self.grad_dtype)
            else:  # summed in the reduce dtype, rounded once into the stored dtype
                self.grad_shard.add_(reduced)
            if self.policy.offloads_optimizer:  # to the host as it lands, during backward;
                # the cycle's last landing is the one the step uses
                self.host_grads = self.grad_shard.to(self.master.device, self.master_dtype,
                                                     non_blocking=True, copy=True)
        self.presence = flags.clone() if self.presence is None else self.presence + flags
        self.fresh = False

    def _land_full_grads(self, summed: torch.Tensor, present: list[bool]) -> None:
        """Averaged full gradients (stage 0): the summed [K, S] buffer (K slots of the
        shard group, summed over all N ranks), divided by N.

        Each gradient gets a padded storage [K, c·row] (the weights' layout), so its
        column range of the buffer lands in one pass that divides, casts to the stored
        dtype and copies at once (the same quotient, rounded once, as dividing the buffer
        first). The local gradients were freed when the reduction was issued, so this
        allocation replaces them rather than adding to them. A parameter no rank saw
        (``present[j]`` false; reading the flags is a host synchronisation the maths
        needs) keeps no gradient: a zero one would count as seen in the next backward
        of the cycle and be stepped with weight decay."""
        n, k = self.comm.dp_world, self.comm.shard_world
        for j, i in enumerate(self.trainable):
            if not present[j]:
                continue
            slot = self.r_layout.slots[j]
            buf = torch.empty(k, slot.chunk_numel, dtype=self.grad_dtype,
                              device=self.device)  # [K, c·row], padded
            torch.div(summed[:, slot.offset:slot.offset + slot.chunk_numel], n, out=buf)
            self.params[i].grad = buf.view(-1)[:slot.numel].view(self.params[i].shape)

    def assign_step_grads(self, present: list[bool]) -> None:
        """Hand the optimizer this rank's reduced gradients (fp32 for a master copy);
        ``present[j]``: some rank saw trainable parameter j this cycle."""
        if self.policy.full_grads is FullGrads.AVERAGED:
            for j, i in enumerate(self.trainable):
                g = self.params[i].grad
                shard = self.shards[i]
                shard.grad = None if not present[j] or g is None else (
                    g.to(self.master_dtype) if self.master is not None else g).view(shard.shape)
            return
        flat = self.host_grads if self.host_grads is not None else self.grad_shard
        if self.master is not None and (flat.dtype != self.master_dtype
                                        or flat.device != self.master.device):
            flat = flat.to(self.master.device, self.master_dtype)  # offload: to the host
        self.step_grads = flat
        for j, view in enumerate(self.g_layout.shard_views(flat, self.rank)):
            self.shards[self.trainable[j]].grad = view if present[j] else None

    def drop_step_grads(self) -> None:
        """Free the fp32 copies for the optimizer: the cycle's next backward renews them."""
        if self.master is not None:
            for i in self.trainable:
                self.shards[i].grad = None
            self.step_grads = None


def _pinned() -> bool:
    """Host buffers are pinned where there is a device to copy to asynchronously."""
    return torch.cuda.is_available()
