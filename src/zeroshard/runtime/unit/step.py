"""After the optimizer step: a unit's compute weights brought up to date with its
updated shards — a cast on this rank, or an all-gather of every rank's updated rows
(``policy.AfterStep``) — and its step-scoped gradients let go."""

from __future__ import annotations

import torch

from ...spec.policy import AfterStep


class UnitStep:
    """Mixin of :class:`~zeroshard.runtime.unit.Unit`: what follows the step."""

    def after_step(self) -> None:
        """Bring the compute weights up to date with the updated shards."""
        self.step_grads = None
        if self.policy.keeps_full_grads:
            # The step has consumed them: the next backward starts a new cycle anyway, so
            # the full gradients go now rather than live through the next forward beside
            # its activations. At stage 0 in fp32 the shard's .grad is a view of them and
            # holds them until the optimizer's zero_grad(), as torch DDP's gradients do.
            for i in self.trainable:
                self.params[i].grad = None
        # The shards' .grad keep what the step used until zero_grad(); the engine lets go,
        # so between steps no gradient memory is held (FSDP2 and DDP behave the same).
        self.grad_shard = self.host_grads = None
        if self.master is not None:
            for i in self.trainable:
                self.shards[i].grad = None  # fp32 copies: free them now
        self.refresh_compute()

    def refresh_compute(self) -> None:
        """Bring the compute weights up to date with the (updated or loaded) shards."""
        if not self.trainable:
            return
        if self.policy.after_step is AfterStep.CAST:
            if self.master is None:
                return  # fp32: the shard is a view of the compute weights, updated in place
            if self.w_shard is not None:
                w_views = self.w_layout.shard_views(self.w_shard, self.rank)
                for i in self.trainable:  # cast on the host first: half the bytes to move
                    w_views[i].copy_(self.shards[i].detach().to(self.compute_dtype))
            else:
                for i in self.trainable:
                    self.params[i].data.copy_(self.shards[i].detach().to(self.compute_dtype)
                                              .view(self.params[i].shape))
        else:  # all-gather every rank's updated rows into every rank's full weights
            self.wait_sync()
            out = torch.empty(self.world, self.g_layout.slot_numel, dtype=self.compute_dtype,
                              device=self.device)
            inp = out[self.rank]  # in place: this rank's slot is the gather's input
            if self.master is not None:
                inp.copy_(self.master.to(self.compute_dtype))  # cast on the host first
            else:
                torch.cat([self.padded[i][self.rank] for i in self.trainable], out=inp)
            self._sync_work = (self.comm.all_gather(out, inp, async_op=True, unit=self.index),
                               out, inp)

    def wait_sync(self) -> None:
        if self._sync_work is None:
            return
        work, out, _ = self._sync_work
        work.wait()
        self._sync_work = None
        full = [self.padded[i] for i in self.trainable]  # [N, c·row] each
        if self.master is not None:  # every rank's rows arrive cast from the master
            self.g_layout.unpack_into(out, full)
            return
        # Without a master the optimizer updated this rank's rows in place: land the
        # other ranks' rows only, (N-1)/N of the unit, in at most two copies.
        r = self.rank
        for rows in (slice(0, r), slice(r + 1, self.world)):
            if rows.start < rows.stop:
                torch.split_with_sizes_copy(out[rows], self.g_layout.split_sizes, dim=1,
                                            out=[t[rows] for t in full])
