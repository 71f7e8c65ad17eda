"""A unit: the parameters gathered together and reduced together.

One code path for every stage; what differs is asked of the unit's ``ShardPolicy``
(stage 0 is a shard group of one for the optimizer state). Every field is declared in
:meth:`Unit.__init__` and changed only by the unit's own methods, which the reducer,
the prefetcher, the step and the offload stream call (the rest is read through
``readout.py``); its collectives in flight are the comm context's (``comm/context.py``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ...offload.disk import place_on_disk
from ...spec.policy import AfterStep, FullGrads, ShardPolicy
from ..comm.collectives import Collectives
from ..comm.context import CommContext
from ..dist import TORCH_DTYPES, host_device
from ..events import Events
from .grads import averaged_grads
from .layout import ShardLayout
from .local import local, local_shape, set_grad
from .progress import BackwardProgress
from .state import UnitState
from .storage import make_storages, optimizer_views
from .view import ModuleView


class Unit:
    """Shards, gradients and collectives of one group of parameters."""

    def __init__(self, index: int, module: nn.Module, named_params: list[tuple[str, nn.Parameter]],
                 policy: ShardPolicy, recipe, comm: Collectives, ctx: CommContext,
                 device: torch.device, events: Events, name: str = ""):
        # -- what the unit is (fixed) ----------------------------------------------------
        self.index, self.module, self.name = index, module, name
        self.policy, self.comm, self.ctx, self.events = policy, comm, ctx, events
        self.names, self.params = [n for n, _ in named_params], [p for _, p in named_params]
        self.trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        mesh = comm.mesh
        # rank and world of the optimizer state's shard group (a group of one at stage 0)
        self.rank, self.world = policy.shard_coords(mesh.shard_rank, mesh.shard_world)
        # over local shapes ([Note: tensor-parallel parameters] in local.py)
        self.w_layout = ShardLayout([local_shape(p) for p in self.params], self.world)
        self.g_layout = ShardLayout([local_shape(self.params[i]) for i in self.trainable],
                                    self.world)
        # Gradients always travel in the K-slot layout of the shard group, stage 0
        # included: on gloo a reduce-scatter is an all-reduce of its input, so stage 0's
        # all-reduce sums every element in the same order: bit for bit as stages 1-3.
        self.r_layout = ShardLayout([s.shape for s in self.g_layout.slots], mesh.shard_world)
        self.compute_dtype, self.grad_dtype = (TORCH_DTYPES[recipe.param_dtype],
                                               TORCH_DTYPES[recipe.grad_dtype])
        self.reduce_dtype = TORCH_DTYPES[recipe.reduce_dtype or recipe.grad_dtype]
        self.master_dtype = TORCH_DTYPES[recipe.master_dtype] if recipe.master_dtype else None
        if policy.offloads_optimizer and self.master_dtype is None:
            self.master_dtype = torch.float32  # fp32 offloaded: the host copy the step updates
        self.device, self.host = device, host_device()
        # -- storages (storage.py) -------------------------------------------------------
        st = make_storages(self.params, self.trainable, self.w_layout, self.g_layout, self.rank,
                           policy, self.compute_dtype, self.master_dtype, device, self.host)
        self.disk = None  # disk offload: the file of the master and moments (offload/disk.py)
        if policy.optimizer_on_disk and st.master is not None:
            self.disk, master = place_on_disk(st.master, policy.offload_dir, comm, index)
            st = st._replace(master=master)
        self.padded = st.padded  # full parameters' storages, [world, c·row] each
        self.master = st.master  # 1D [S_g]: this rank's slot of fp32 master weights
        self.w_shard = st.w_shard  # 1D [S_w], stage 3: this rank's slot of compute weights
        self.shards = optimizer_views(self.params, self.trainable, self.w_layout,
                                      self.g_layout, self.rank, st)
        # -- the full weights' lifecycle (stage 3) ---------------------------------------
        self.state = UnitState.GATHERED
        self.prefetched = False  # gathered ahead of use, not used yet
        self.w_secondary = None  # hpZ: [K/K2, S] slots kept from forward for backward
        # -- this cycle's gradients ------------------------------------------------------
        self.progress = BackwardProgress(len(self.trainable))  # what still reads the weights
        self.ready = False  # this backward is done with the unit's parameters
        self.fresh = True  # the next reduced gradient overwrites the accumulator
        self.presence = None  # [F] per trainable param: ranks x micro-batches with a gradient
        # 1D [S_g]: this cycle's reduced gradients (accumulated over its backwards at
        # stages 2-3); made by the cycle's first reduction, dropped after the step
        self.grad_shard = None
        self.host_grads = None  # offload: the reduced slot copied to the host (master dtype)
        self.step_grads = None  # 1D fp32 gradients handed to the optimizer (transient)
        self.sync_whole = False  # the sync in flight brings this rank's rows too (cast)
        self.view = ModuleView(self)  # what the module shows ([Note: module view], view.py)
        if policy.shards_params:
            self.release()

    # -- sharded parameters (stage 3): gather and release ---------------------------
    def start_gather(self, prefetch: bool = False) -> None:
        """Issue the all-gather of the compute weights; ``prefetch``: ahead of use."""
        if self.state is not UnitState.SHARDED:
            return
        out = torch.empty(self.world, self.w_layout.slot_numel, dtype=self.compute_dtype,
                          device=self.device)
        if self.w_secondary is not None and torch._C._current_graph_task_id() != -1:
            # hpZ, in backward: inside the secondary group only (a forward always gathers the
            # shards: a secondary copy left by a forward no backward used is stale by then)
            work = self.comm.all_gather(out, self.w_secondary, async_op=True, unit=self.index,
                                        secondary=True)
        else:
            work = self.comm.all_gather(out, self.w_shard.to(self.device, non_blocking=True),
                                        async_op=True, unit=self.index, weights=True)
        self.ctx.issue("gather", self.index, work, out)
        self.state = UnitState.GATHERING
        self.prefetched = prefetch
        self.events.emit("gather_issued", self)

    def gather(self) -> None:
        """Finish (or issue and finish) the all-gather into the full parameters' storages."""
        self.prefetched = False  # in use now
        if self.state is UnitState.GATHERED:
            return
        self.start_gather()
        (out,) = self.ctx.land("gather", self.index)
        for p, buf in zip(self.params, self.padded):
            local(p).untyped_storage().resize_(buf.numel() * buf.element_size())
        self.w_layout.unpack_into(out, self.padded)
        self.view.show(self.params)
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
        mesh = self.comm.mesh
        if keep_secondary and mesh.secondary_world and self.state is UnitState.GATHERED:
            m = self.world // mesh.secondary_world
            j = mesh.secondary_rank
            self.w_secondary = torch.cat([buf[j * m:(j + 1) * m] for buf in self.padded],
                                         dim=1)  # [m, S], the gather's slot layout
        self.view.show(self.view.sharded)  # the module shows rows, not emptied storages
        for p in self.params:
            local(p).untyped_storage().resize_(0)
        self.state = UnitState.SHARDED
        self.events.emit("release", self)

    def drop_secondary(self) -> None:
        """hpZ: a unit the backward did not reach keeps no secondary copy past it."""
        self.w_secondary = None

    # -- gradients ------------------------------------------------------------------
    def start_backward(self, new_cycle: bool) -> None:
        self.progress.start()
        self.ready = False
        if new_cycle:
            self.fresh = True
            self.host_grads = None
            self.presence = None
            self.step_grads = None
            if self.policy.keeps_full_grads:  # the last cycle's, still held
                for i in self.trainable:
                    self.params[i].grad = None

    def grad_arrived(self) -> bool:
        """A trainable parameter has its gradient; True when it was the last."""
        return self.progress.grad_arrived()

    def inputs_done(self) -> None:
        """A forward call's input gradients are computed (``progress.py``)."""
        self.progress.input_done()
        if self.policy.shards_params and self.progress.finished:
            self.release()

    def backward_done(self) -> None:
        """Every gradient of the unit is in (or backward ended): release the weights
        where the policy shards them, unless an input gradient still reads them."""
        self.ready = True
        self.events.emit("backward_end", self)
        if self.policy.shards_params and self.progress.finished:
            self.release()

    def reduction_issued(self, work, buf: torch.Tensor, part: torch.Tensor) -> None:
        """This unit's gradients are packed into ``buf``; ``part`` of the result is its
        share. The local full gradients go now where the policy frees them."""
        self.ctx.issue("reduce", self.index, work, buf, part)
        if self.policy.frees_grads_when_packed:
            for i in self.trainable:
                self.params[i].grad = None
        self.events.emit("reduce_issued", self)

    def advance_reduce(self) -> None:
        """Hybrid sharding: land the reduction inside the shard group and issue the one
        across replica groups, not waiting for it (it overlaps what follows); the
        reduce-scatter's input buffer goes now. Otherwise, :meth:`wait_reduce`."""
        if not self.ctx.pending("reduce", self.index):
            return
        buffers = self.ctx.buffers(self.index)
        keep = buffers[-1:] if self.policy.reduce == "reduce_scatter" else buffers
        if not self.ctx.advance("reduce", self.index, *keep):
            self.wait_reduce()

    def wait_reduce(self) -> None:
        """Finish an issued reduction: average, then store where the stage keeps it."""
        landed = self.ctx.land("reduce", self.index)
        if landed is None:
            return
        out = landed[-1]
        self.events.emit("reduce_done", self)
        S = self.r_layout.slot_numel
        full = self.policy.full_grads
        if full is FullGrads.AVERAGED:  # [K, S + F]: every slot, averaged into full grads
            flags = out[0, S:]  # summed over every rank: > 0 where any rank saw it
            grads = averaged_grads(out[:, :S], (flags > 0).tolist(), self.r_layout,
                                   self.comm.mesh.dp_world, self.grad_dtype)
            for i, g in zip(self.trainable, grads):
                set_grad(self.params[i], g)
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

    # -- the step -------------------------------------------------------------------
    def assign_step_grads(self, present: list[bool]) -> None:
        """Hand the optimizer this rank's reduced gradients (fp32 for a master copy);
        ``present[j]``: some rank saw trainable parameter j this cycle."""
        if self.policy.full_grads is FullGrads.AVERAGED:
            for j, i in enumerate(self.trainable):
                g = local(self.params[i].grad)
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

    def after_step(self, weights_updated: bool = False) -> None:
        """Let go of the cycle's gradients and bring the compute weights up to date with
        the updated shards; ``weights_updated``: the step wrote the update into the
        compute weights already (disk offload's streamed step), so nothing is cast."""
        self.step_grads = self.grad_shard = self.host_grads = None
        for i in self.trainable:
            # The step has consumed the full gradients: the next backward starts a new
            # cycle anyway, so they go now rather than live through the next forward
            # beside its activations. At stage 0 in fp32 the shard's .grad is a view of
            # them and holds them until the optimizer's zero_grad(), as torch DDP's do.
            if self.policy.keeps_full_grads:
                self.params[i].grad = None
            if self.master is not None:
                self.shards[i].grad = None  # fp32 copies: free them now
        self.refresh_compute(from_weights=weights_updated)

    def refresh_compute(self, from_weights: bool = False) -> None:
        """Bring the compute weights up to date with the (updated or loaded) shards:
        ``policy.after_step`` says how. ``from_weights``: this rank's rows of the compute
        weights are current already; only the other ranks' rows are wanted."""
        if not self.trainable:
            return
        if self.policy.after_step is AfterStep.CAST:
            if self.master is None or from_weights:
                return  # fp32: the shard is a view of the compute weights, updated in place
            if self.w_shard is not None:
                w_views = self.w_layout.shard_views(self.w_shard, self.rank)
                for i in self.trainable:  # cast on the host first: half the bytes to move
                    w_views[i].copy_(self.shards[i].detach().to(self.compute_dtype))
            else:
                for i in self.trainable:
                    w = local(self.params[i]).data
                    w.copy_(self.shards[i].detach().to(self.compute_dtype).view(w.shape))
            return
        # all-gather every rank's updated rows into every rank's full weights
        self.wait_sync()
        out = torch.empty(self.world, self.g_layout.slot_numel, dtype=self.compute_dtype,
                          device=self.device)
        inp = out[self.rank]  # in place: this rank's slot is the gather's input
        if self.master is not None and not from_weights:
            inp.copy_(self.master.to(self.compute_dtype))  # cast on the host first
        else:
            torch.cat([self.padded[i][self.rank] for i in self.trainable], out=inp)
        work = self.comm.all_gather(out, inp, async_op=True, unit=self.index)
        self.ctx.issue("sync", self.index, work, out, inp)
        self.sync_whole = self.master is not None and not from_weights

    def wait_sync(self) -> None:
        landed = self.ctx.land("sync", self.index)
        if landed is None:
            return
        out = landed[0]
        full = [self.padded[i] for i in self.trainable]  # [N, c·row] each
        if self.sync_whole:  # every rank's rows arrive cast from the master
            self.g_layout.unpack_into(out, full)
            return
        # Without a master the optimizer updated this rank's rows in place: land the
        # other ranks' rows only, (N-1)/N of the unit, in at most two copies.
        r = self.rank
        for rows in (slice(0, r), slice(r + 1, self.world)):
            if rows.start < rows.stop:
                torch.split_with_sizes_copy(out[rows], self.g_layout.split_sizes, dim=1,
                                            out=[t[rows] for t in full])
