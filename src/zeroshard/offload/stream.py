"""Disk offload's optimizer step: AdamW streamed through host memory in sub-groups.

This rank's optimizer partition is every disk unit's slot, in unit order, cut into
sub-groups of ``sub_group_size`` elements (DeepSpeed's meaning; a sub-group may span
parameters and units). For sub-group k the step

1. queues the read of k + 1 (master, ``exp_avg``, ``exp_avg_sq``) into the other of two
   buffers, behind the write-back of k - 1 that leaves it, and waits for its own read,
3. steps it with torch's fused AdamW kernel (``torch._fused_adamw_``, as
   ``HostAdamW``), one call per param group, on the segments of the parameters that
   have a gradient (the fp32 host gradients offload lands during backward),
4. casts each updated segment to the compute dtype on the host and copies it into the
   device's weights — stage 3's weight shard, or this rank's rows of the full weights
   that stages 1-2 all-gather after the step,
5. starts writing k back.

Reads and writes run in order on one background thread (``os.preadv``/``os.pwritev`` and
the kernel release the GIL) while the current sub-group steps, so the host holds two
sub-groups of master and moments whatever the model's size, and a sub-group takes the
longer of its step and the I/O beside it (one write and one read). The update is
elementwise, and torch's fused kernel gives the same bits on any split of a tensor, so
the result is ``AdamW(fused=True)``'s on the whole tensors, bit for bit.
Hyper-parameters come from the user's optimizer's param groups at each step (LR
schedulers keep working); its own ``step()`` then finds no gradient and does nothing.
Its state holds the step counts and, as ``exp_avg``/``exp_avg_sq``, tensors over the
files: its ``state_dict()`` reads them there.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from .disk import OffloadDiskError
from .host_adam import HostAdamW

_REFUSED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


def check_streamable(optimizer) -> None:
    """Refuse, in one line, an optimizer the streamed AdamW step cannot reproduce."""
    name = type(optimizer).__name__
    if type(optimizer) not in (torch.optim.AdamW, HostAdamW):
        raise ValueError(f"offload_dir: the optimizer state on disk is stepped by a streamed "
                         f"AdamW (torch's fused kernel), which cannot reproduce {name}; use "
                         "torch.optim.AdamW or zeroshard.offload.HostAdamW")
    for k, group in enumerate(optimizer.param_groups):
        for flag in _REFUSED_FLAGS:
            if group.get(flag, False):
                raise ValueError(f"offload_dir: {name} param group {k} has {flag}=True, which "
                                 f"the streamed AdamW step does not do; accepted: {flag}=False")


#: Elements a cut inside a parameter is a multiple of, from the parameter's start. torch's
#: fused CPU AdamW hands its threads 64-byte units and runs its vector loop over them,
#: leaving scalar code for the tensor's tail only; the scalar code rounds some updates
#: differently (measured), so every segment but a parameter's last must be whole vectors.
_ALIGN = 64


def _aligned(cut: int, ranges) -> int:
    """``cut`` moved down to a multiple of ``_ALIGN`` from the start of the parameter it
    falls inside (unchanged between parameters)."""
    for a, b in ranges:
        if a < cut < b:
            return a + (cut - a) // _ALIGN * _ALIGN
    return cut


def _cut(units, size: int) -> list[list[tuple]]:
    """Sub-groups of about ``size`` elements over the units' slots, in order: each a
    list of ``(unit, lo, hi, at)`` — slot elements [lo, hi) at buffer offset ``at``."""
    groups, current, used = [], [], 0
    for u in units:
        ranges = [(s.offset, s.offset + s.real_rows(u.rank) * s.row_numel)
                  for s in u.g_layout.slots]
        lo, n = 0, u.disk.numel
        while lo < n:
            hi = _aligned(min(n, lo + size - used), ranges)
            if hi <= lo and current:  # the room left ends within one vector: next group
                groups.append(current)
                current, used = [], 0
                continue
            if hi <= lo:  # a sub-group smaller than a vector: one vector, or the rest
                hi = min(n, next(min(b, lo + _ALIGN) for a, b in ranges if a <= lo < b))
            current.append((u, lo, hi, used))
            used, lo = used + hi - lo, hi
            if used >= size:
                groups.append(current)
                current, used = [], 0
    if current:
        groups.append(current)
    return groups


def _destination(u, i: int) -> torch.Tensor:
    """The compute weights this rank's rows of parameter i are sent to, flat."""
    if u.w_shard is not None:  # stage 3: the weight shard
        return u.w_layout.shard_views(u.w_shard, u.rank)[i].reshape(-1)
    slot = u.w_layout.slots[i]
    return u.padded[i][u.rank][:slot.real_rows(u.rank) * slot.row_numel]


class DiskStep:
    """The streamed step over every disk unit of one model on this rank."""

    def __init__(self, units, sub_group_size: int):
        self.units = [u for u in units if u.disk is not None]
        self.groups = _cut(self.units, sub_group_size)
        self.group_numel = max((g[-1][3] + g[-1][2] - g[-1][1] for g in self.groups),
                               default=0)
        self.buffers: list[torch.Tensor] = []  # two [3, group_numel] fp32, from the first step
        # (unit, j) whose moments in the file are still the zeros written at zs.shard time
        self._zero = {(u.index, j) for u in self.units for j in range(len(u.trainable))}
        self._pool: ThreadPoolExecutor | None = None

    def buffer_bytes(self) -> int:
        """Host bytes of the sub-group buffers that exist."""
        return sum(b.numel() * b.element_size() for b in self.buffers)

    # -- state -----------------------------------------------------------------------
    def _adopt_state(self, optimizer, owned: dict) -> None:
        """Make the optimizer's state for every disk shard point into the files: state
        it holds in memory (loaded from a checkpoint or a state dict) is written there
        first; a shard stepped for the first time starts from zero moments."""
        zeros = None
        for u in self.units:
            m_views = u.g_layout.shard_views(u.disk.planes[1], u.rank)
            v_views = u.g_layout.shard_views(u.disk.planes[2], u.rank)
            for j, i in enumerate(u.trainable):
                shard, start = u.shards[i], u.g_layout.slots[j].offset
                if id(shard) not in owned:  # another optimizer's parameter
                    continue
                state = optimizer.state.get(shard)
                if not state:
                    if shard.grad is None:
                        continue
                    state = optimizer.state[shard] = {"step": torch.tensor(0.0)}
                for key, plane, view in (("exp_avg", 1, m_views[j]),
                                         ("exp_avg_sq", 2, v_views[j])):
                    held = state.get(key)
                    if held is not None and held.data_ptr() == view.data_ptr():
                        continue
                    if held is not None and tuple(held.shape) != tuple(shard.shape):
                        raise ValueError(
                            f"optimizer state {key!r} of a {tuple(shard.shape)} shard has "
                            f"shape {tuple(held.shape)}; accepted: AdamW's state of this "
                            "model's shards (state_dict() or zs.load)")
                    if held is not None:
                        u.disk.write(start, held.detach().float().cpu().contiguous()
                                     .reshape(-1), "writing optimizer state to", plane)
                    elif (u.index, j) not in self._zero:  # a fresh moment over old ones
                        if zeros is None:
                            zeros = torch.zeros(min(u.disk.numel, 1 << 20))
                        u.disk.fill(plane, start, start + shard.numel(), zeros)
                    state[key] = view
                self._zero.discard((u.index, j))
                step = state.get("step", 0.0)
                if not torch.is_tensor(step) or step.dtype != torch.float32:
                    state["step"] = torch.tensor(float(step), dtype=torch.float32)

    # -- the step --------------------------------------------------------------------
    @torch.no_grad()
    def step(self, optimizer) -> None:
        """Step every disk shard that has a gradient; leave no gradient on them."""
        active = {}  # (unit index, j) -> (group, step, grad flat, destination flat)
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        if any(u.shards[i].grad is not None for u in self.units for i in u.trainable):
            for u in self.units:
                u.disk.drop_mapped()
            self._adopt_state(optimizer, group_of)
        for u in self.units:
            for j, i in enumerate(u.trainable):
                shard = u.shards[i]
                if shard.grad is not None and id(shard) in group_of:
                    active[(u.index, j)] = (group_of[id(shard)], optimizer.state[shard]["step"],
                                            shard.grad.reshape(-1), _destination(u, i))
        if active:
            # t <- t + 1 once per parameter, as the fused AdamW does, before any segment
            torch._foreach_add_([a[1] for a in active.values()], 1)
            self._stream(active)
        for u in self.units:  # this optimizer's: its own step() then finds nothing to do
            for i in u.trainable:
                if id(u.shards[i]) in group_of:
                    u.shards[i].grad = None

    def _stream(self, active: dict) -> None:
        groups = self.groups
        if not groups:
            return
        if not self.buffers:
            self.buffers = [torch.empty(3, self.group_numel)
                            for _ in range(min(2, len(groups)))]
            # One I/O thread: its queue runs in order, so the write-back of sub-group
            # k - 1 always ends before the read of k + 1 into the same buffer begins, and
            # both run while k steps; a drive serves reads and writes one at a time anyway.
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="zeroshard-disk")
        nbuf = len(self.buffers)
        reads, writes = {0: self._pool.submit(self._io, groups[0], self.buffers[0], False)}, {}
        failure = None
        try:
            for k, group in enumerate(groups):
                if k + 1 < len(groups):  # queued behind the write-back of k + 1 - nbuf
                    reads[k + 1] = self._pool.submit(self._io, groups[k + 1],
                                                     self.buffers[(k + 1) % nbuf], False)
                reads.pop(k).result()
                self._step_group(group, self.buffers[k % nbuf], active)
                writes[k] = self._pool.submit(self._io, group, self.buffers[k % nbuf], True)
        except BaseException as exc:  # a disk error, or anything that stops a half-done step
            failure = exc
        finally:  # no thread may still use a buffer when this returns or raises
            for f in [*reads.values(), *writes.values()]:
                try:
                    f.result()
                except OffloadDiskError as exc:
                    failure = failure or exc
        if failure is not None:  # the files hold a half-stepped state: they go now, and
            for u in self.units:  # give their space back; the last checkpoint is the truth
                u.disk.remove()
            raise failure

    @staticmethod
    def _io(group, buf: torch.Tensor, write: bool) -> None:
        for u, lo, hi, at in group:
            for plane in range(3):
                part = buf[plane, at:at + hi - lo]
                if write:
                    u.disk.write(lo, part, "writing optimizer state to", plane)
                else:
                    u.disk.read(lo, part, plane)

    @staticmethod
    def _step_group(group, buf: torch.Tensor, active: dict) -> None:
        by_group: dict[int, tuple] = {}
        sends = []
        for u, lo, hi, at in group:
            for j in range(len(u.trainable)):
                hit = active.get((u.index, j))
                if hit is None:
                    continue
                slot = u.g_layout.slots[j]
                off, n = slot.offset, slot.real_rows(u.rank) * slot.row_numel
                a, b = max(lo, off), min(hi, off + n)
                if a >= b:
                    continue
                pg, step, grad, dest = hit
                lists = by_group.setdefault(id(pg), (pg, [], [], [], [], []))
                rows = slice(at + a - lo, at + b - lo)
                for lst, t in zip(lists[1:], (buf[0, rows], grad[a - off:b - off],
                                              buf[1, rows], buf[2, rows], step)):
                    lst.append(t)
                sends.append((dest[a - off:b - off], buf[0, rows]))
        for pg, params, grads, m, v, steps in by_group.values():
            beta1, beta2 = pg["betas"]
            torch._fused_adamw_(params, grads, m, v, [], steps, lr=pg["lr"], beta1=beta1,
                                beta2=beta2, weight_decay=pg["weight_decay"], eps=pg["eps"],
                                amsgrad=False, maximize=False)
        for dest, master in sends:  # cast on the host first: half the bytes to move
            dest.copy_(master if dest.dtype == master.dtype else master.to(dest.dtype))
