"""What a unit tells the rest of the engine: its lifecycle state, the bytes it holds by
ledger category (:meth:`UnitView.memory`, :meth:`UnitView.buffers_in_flight`), the rows
this rank holds of each parameter (:meth:`UnitView.held_rows`, for checkpoints), the
gradient rows it counts in a global norm (:meth:`UnitView.norm_grads`, for clipping)
and the full values (:meth:`UnitView.full_tensors`). The ledger, clipping, checkpoints
and the profiler read a unit through these alone."""

from __future__ import annotations

import enum

import torch

from ...spec.policy import FullGrads
from ..ledger import CATEGORIES, optimizer_state_bytes, tensor_bytes
from .layout import dim0_chunk


class UnitState(enum.Enum):
    """What a unit's full parameters hold."""

    SHARDED = "sharded"
    """Stage 3 between uses: full parameters have zero-size storage; only the slot of
    compute weights (1/N of the unit, padded) is held."""
    GATHERING = "gathering"
    """Stage 3: an all-gather is in flight (a prefetch); the full parameters are still
    empty, the gathered [N, S] buffer is allocated."""
    GATHERED = "gathered"
    """Full parameters allocated and filled: always below stage 3; at stage 3 from
    the unit's gather before forward (or backward) to its release after it."""


class UnitView:
    """The public, read-only face of :class:`~zeroshard.runtime.unit.Unit`."""

    # -- inspection ------------------------------------------------------------------
    def held_rows(self, i: int) -> tuple[torch.Tensor, int]:
        """The tensor this rank reads and writes parameter ``i``'s values through, and the
        first full row it holds: the optimizer-facing shard (rows of the dim-0 chunk
        ``dim0_chunk(rows, rank, world)``), or, for a frozen parameter kept whole, the
        compute weight itself from row 0."""
        if i in self.trainable or self.w_shard is not None:
            rows = self.params[i].shape[0] if self.params[i].dim() else 1
            return self.shards[i], dim0_chunk(rows, self.rank, self.world)[0]
        return self.params[i], 0

    def norm_grads(self) -> list[torch.Tensor]:
        """The part of each shard's gradient this rank counts in a global norm: its own
        rows, or where the shard is whole (stage 0) the rows it would own in its shard
        group, so every stage sums the same partial norms (summed over the shard group:
        the replica groups hold the same rows)."""
        out = []
        for i in self.trainable:
            g = self.shards[i].grad
            if g is None:
                continue
            if self.world == 1 and self.comm.shard_world > 1:
                rows = self.params[i].shape[0] if self.params[i].dim() else 1
                a, b = dim0_chunk(rows, self.comm.shard_rank, self.comm.shard_world)
                g = g.reshape(rows, -1)[a:b]
            out.append(g)
        return out

    def memory(self, optimizer=None) -> dict[str, int]:
        """Bytes this unit holds on this rank by ledger category (``runtime/ledger.py``),
        read off the tensors themselves; communication buffers in flight are
        :meth:`buffers_in_flight` (the units of a reduce bucket share one)."""
        pol, r, out = self.policy, self.rank, dict.fromkeys(CATEGORIES, 0)
        w_item = self.compute_dtype.itemsize
        if pol.shards_params:  # the slot between uses; the full weights while gathered
            out["params"] += self.w_layout.real_numel(r) * w_item
            out["padding"] += (self.w_layout.slot_numel - self.w_layout.real_numel(r)) * w_item
            if self.state is UnitState.GATHERED:
                out["gathered"] += sum(tensor_bytes(b) for b in self.padded)
            if self.w_secondary is not None:  # hpZ: kept from forward for backward
                out["gathered"] += tensor_bytes(self.w_secondary)
        else:  # full, in padded storages
            out["params"] += self.w_layout.numel * w_item
            out["padding"] += sum(tensor_bytes(b) for b in self.padded) - out["params"]
        g_real, g_slot = self.g_layout.real_numel(r), self.g_layout.slot_numel
        if pol.keeps_full_grads:
            averaged = pol.full_grads is FullGrads.AVERAGED
            for i in self.trainable:
                g = self.params[i].grad
                if g is None and averaged and self.master is None:
                    g = self.shards[i].grad  # after the step: a view of them, until zero_grad()
                if g is not None:
                    out["grads"] += tensor_bytes(g)
                    if averaged:  # landed in a padded [N, c·row] storage: the rest is padding
                        out["padding"] += g.untyped_storage().nbytes() - tensor_bytes(g)
            if self.grad_shard is not None:  # stage 1's reduced slot, until the step
                out["buffers"] += tensor_bytes(self.grad_shard)
        elif self.grad_shard is not None:  # between a cycle's first reduction and its step
            out["grads"] += g_real * self.grad_dtype.itemsize
            out["padding"] += (g_slot - g_real) * self.grad_dtype.itemsize
        if self.disk is not None:  # the file: master and both moments, padding included
            for c, b in self.disk_bytes().items():
                out[c] += b
        elif self.master is not None:
            out["optimizer"] += g_real * self.master_dtype.itemsize
            out["padding"] += (g_slot - g_real) * self.master_dtype.itemsize
            if not pol.shards_optimizer:  # fp32 copies of the full gradients for the step
                out["buffers"] += sum(tensor_bytes(self.shards[i].grad) for i in self.trainable
                                      if self.shards[i].grad is not None)
        if self.disk is None:
            out["optimizer"] += optimizer_state_bytes(optimizer, self.shards)
        if self.step_grads is not None and self.step_grads is not self.grad_shard:
            out["buffers"] += tensor_bytes(self.step_grads)
        if self.host_grads is not None and self.host_grads is not self.step_grads:
            out["buffers"] += tensor_bytes(self.host_grads)  # offload: landed, not yet handed
        return out

    def host_bytes(self, optimizer=None) -> dict[str, int]:
        """The part of :meth:`memory` that lives on the host (offload): the master, its
        padding and the optimizer state (in :meth:`disk_bytes` instead with
        ``offload_dir``), the step's fp32 gradients, and with ``offload="params"`` the
        weight shard and its padding."""
        out = dict.fromkeys(CATEGORIES, 0)
        pol, r = self.policy, self.rank
        if pol.offloads_optimizer and self.master is not None:
            g_real, g_slot = self.g_layout.real_numel(r), self.g_layout.slot_numel
            if self.disk is None:
                out["optimizer"] += (g_real * self.master_dtype.itemsize
                                     + optimizer_state_bytes(optimizer, self.shards))
                out["padding"] += (g_slot - g_real) * self.master_dtype.itemsize
            if self.step_grads is not None and self.step_grads is not self.grad_shard:
                out["buffers"] += tensor_bytes(self.step_grads)
            if self.host_grads is not None and self.host_grads is not self.step_grads:
                out["buffers"] += tensor_bytes(self.host_grads)
        if pol.shards_params and pol.where("params") == "host":
            w_item, w_real = self.compute_dtype.itemsize, self.w_layout.real_numel(r)
            out["params"] += w_real * w_item
            out["padding"] += (self.w_layout.slot_numel - w_real) * w_item
        return out

    def disk_bytes(self) -> dict[str, int]:
        """The part of :meth:`memory` in files (disk offload): the master and Adam's two
        moments, three fp32 planes of the slot, its padding included."""
        out = dict.fromkeys(CATEGORIES, 0)
        if self.disk is not None:
            g_real = self.g_layout.real_numel(self.rank)
            out["optimizer"] = 3 * 4 * g_real
            out["padding"] = 3 * 4 * (self.disk.numel - g_real)
        return out

    def buffers_in_flight(self) -> list[torch.Tensor]:
        """Communication buffers of this unit's collectives not yet landed."""
        return [t for pending in (self._in_flight, self._sync_work, self._gather_work)
                if pending is not None for t in pending[1:]]

    def full_tensors(self) -> dict[str, torch.Tensor]:
        """Full values under original names: the master where there is one (the source
        of truth), else the compute weights. A collective over the shard group."""
        values = {}
        whole = self.w_shard is None
        for i, p in enumerate(self.params):
            if whole and (self.master is None or i not in self.trainable):
                values[self.names[i]] = p.detach().clone()
        masters = [i for i in self.trainable] if self.master is not None else []
        if masters and self.world == 1:
            for i in masters:
                values[self.names[i]] = self.shards[i].detach().clone().view(self.params[i].shape)
        elif masters:
            out = torch.empty(self.world * self.g_layout.slot_numel, dtype=self.master_dtype,
                              device=self.device)
            self.comm.all_gather(out, self.master)
            for i, t in zip(masters, self.g_layout.unpack(out)):
                values[self.names[i]] = t
        if not whole:
            rest = [i for i in range(len(self.params)) if self.names[i] not in values]
            out = torch.empty(self.world * self.w_layout.slot_numel, dtype=self.compute_dtype,
                              device=self.device)
            self.comm.all_gather(out, self.w_shard)
            full = self.w_layout.unpack(out)
            for i in rest:
                values[self.names[i]] = full[i]
        return values
