"""Offload: the optimizer state and the master weights placed in host memory or on
disk, the host AdamW step, and disk offload's streamed step.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# ----------------------------------------------------------------------------------------
# Disk offload's files: each unit's fp32 master and Adam's two moments in one file.
#
# A unit's file holds three planes of the unit's optimizer slot (``g_layout.slot_numel``
# fp32 elements each, padding included): the master, ``exp_avg``, ``exp_avg_sq``. The
# files of one model on one rank live in a scratch folder of their own under
# ``offload_dir`` (``zeroshard-offload-rankR-*``); a unit's file goes when its unit does,
# and at the latest when the process exits cleanly (``weakref.finalize``), and the folder
# with its last file. They are never a checkpoint: ``zs.save`` reads them into its own
# files, and a crash leaves the last checkpoint the only truth.
#
# Two ways in, for two kinds of reader:
#
# * The step streams sub-groups with ``os.preadv``/``os.pwritev`` into buffers it owns
#   (``stream.py``). Plain file I/O because the kernel's page cache is not the process's
#   memory: the process holds exactly the buffers, the calls release the GIL (so a
#   background thread reads and writes while torch's kernel steps), and a write that fails
#   (a full disk) is an ``OSError`` here, not a ``SIGBUS`` in the middle of a kernel.
# * Everyone else — ``state_dict()``, ``zs.save``, ``full_state_dict()``, loading — sees
#   tensors: the master and moments as ``torch.frombuffer`` views of a shared ``mmap`` of
#   the same file (one page cache, so both ways agree). What such a reader touches is
#   mapped into the process until the next step drops it (``MADV_DONTNEED``: the pages
#   stay in the page cache and in the file).
#
# Every byte is written when the file is made (the master, then zeros): a disk too small
# for the state is an error at ``zs.shard``, and later writes only overwrite allocated
# blocks.
# ----------------------------------------------------------------------------------------

#: The planes of a unit's file, in order.
PLANES = ("master", "exp_avg", "exp_avg_sq")
_ITEM = 4  # fp32
_CHUNK = 1 << 26  # bytes per read or write call (Linux moves at most ~2 GiB per call)
_FOLDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # comm -> its folder


class OffloadDiskError(RuntimeError):
    """The optimizer state's files could not be written or read."""


def io_error(exc: OSError, path: str, what: str) -> OffloadDiskError:
    """One line naming the path, what was being done and why it failed."""
    folder = os.path.dirname(os.path.dirname(path))
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return OffloadDiskError(
            f"offload_dir {folder!r} is full: {what} {path} failed ({exc.strerror}); the "
            "run stops here and checkpoints saved before are untouched: free space or "
            "choose another offload_dir")
    return OffloadDiskError(f"offload_dir {folder!r}: {what} {path} failed "
                            f"({exc.strerror or exc})")


def scratch_folder(offload_dir: str, comm) -> str:
    """The folder this model's files go in on this rank (one per ``Collectives``)."""
    folder = _FOLDERS.get(comm)
    if folder is None or not os.path.isdir(folder):  # none yet, or removed once emptied
        try:
            folder = tempfile.mkdtemp(prefix=f"zeroshard-offload-rank{comm.mesh.dp_rank}-",
                                      dir=offload_dir)
        except OSError as exc:
            raise io_error(exc, os.path.join(offload_dir, "x", "x"),
                           "making a scratch folder in") from None
        _FOLDERS[comm] = folder
    return folder


def _remove(fd: int, path: str) -> None:
    for step in (lambda: os.close(fd), lambda: os.unlink(path),
                 lambda: os.rmdir(os.path.dirname(path))):  # the folder, once empty
        try:
            step()
        except OSError:
            pass


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


class UnitFile:
    """The file of one unit's master and moments, ``numel`` fp32 elements a plane."""

    def __init__(self, folder: str, index: int, master: torch.Tensor):
        self.numel = master.numel()
        self.path = os.path.join(folder, f"unit{index:05d}.bin")
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise io_error(exc, self.path, "creating") from None
        self.remove = weakref.finalize(self, _remove, self.fd, self.path)
        """Close and delete the file now (it is, at the latest, when this object goes)."""
        self.write(0, master.detach().cpu().float().contiguous(), "writing the master to")
        zeros = torch.zeros(min(self.numel, _CHUNK // _ITEM), dtype=torch.float32)
        for plane in (1, 2):
            self.fill(plane, 0, self.numel, zeros)
        self._map = mmap.mmap(self.fd, 3 * self.numel * _ITEM)
        self.planes = torch.frombuffer(self._map, dtype=torch.float32).view(3, self.numel)
        """The three planes as tensors over the file (see the module's note)."""

    def _io(self, offset: int, view: memoryview, write: bool, what: str) -> None:
        if not self.remove.alive:  # its descriptor is closed and may name another file now
            raise OffloadDiskError(f"offload_dir: {self.path} was removed after a step failed "
                                   "on it; this model cannot step again: resume from the "
                                   "last checkpoint")
        done = 0
        while done < len(view):
            part = view[done:done + _CHUNK]
            try:
                n = (os.pwritev(self.fd, [part], offset + done) if write
                     else os.preadv(self.fd, [part], offset + done))
            except OSError as exc:
                raise io_error(exc, self.path, what) from None
            if n == 0:
                raise OffloadDiskError(f"offload_dir: {self.path} ends before byte "
                                       f"{offset + done} (truncated by another program?)")
            done += n

    def write(self, start: int, values: torch.Tensor, what: str = "writing to",
              plane: int = 0) -> None:
        """Write fp32 ``values`` at element ``start`` of ``plane``."""
        self._io((plane * self.numel + start) * _ITEM, _bytes(values), True, what)

    def read(self, start: int, out: torch.Tensor, plane: int = 0) -> None:
        """Read ``out.numel()`` elements from element ``start`` of ``plane``."""
        self._io((plane * self.numel + start) * _ITEM, _bytes(out), False, "reading")

    def fill(self, plane: int, start: int, stop: int, zeros: torch.Tensor) -> None:
        """Zeros over elements [start, stop) of ``plane`` (``zeros`` a zero buffer)."""
        while start < stop:
            n = min(stop - start, zeros.numel())
            self.write(start, zeros[:n], "writing zeros to", plane)
            start += n

    def drop_mapped(self) -> None:
        """Unmap what readers of the tensors touched (it stays in the page cache)."""
        self._map.madvise(mmap.MADV_DONTNEED)


def place_on_disk(master: torch.Tensor, offload_dir: str, comm, index: int):
    """Move a unit's freshly filled master into its file: ``(file, master plane)``; a
    unit with nothing to step keeps its empty master and gets no file."""
    if not master.numel():
        return None, master
    disk, problem = None, None
    try:
        disk = UnitFile(scratch_folder(offload_dir, comm), index, master)
    except OffloadDiskError as exc:
        problem = f"rank {comm.mesh.dp_rank}: {exc}"
    # Every rank learns of a failure on any (one disk fuller than another's): all stop
    # here with the same line, rather than the others wait in a later collective.
    problems = [None] * comm.mesh.dp_world
    dist.all_gather_object(problems, problem, group=comm.mesh.dp_group)
    first = next((p for p in problems if p), None)
    if first:
        raise OffloadDiskError(first)
    return disk, disk.planes[0]


# ----------------------------------------------------------------------------------------
# Disk offload's optimizer step: AdamW streamed through host memory in sub-groups.
#
# This rank's optimizer partition is every disk unit's slot, in unit order, cut into
# sub-groups of ``sub_group_size`` elements (DeepSpeed's meaning; a sub-group may span
# parameters and units). For sub-group k the step
#
# 1. queues the read of k + 1 (master, ``exp_avg``, ``exp_avg_sq``) into the other of two
#    buffers, behind the write-back of k - 1 that leaves it, and waits for its own read,
# 3. steps it with torch's fused AdamW kernel (``torch._fused_adamw_``, as
#    ``HostAdamW``), one call per param group, on the segments of the parameters that
#    have a gradient (the fp32 host gradients offload lands during backward),
# 4. casts each updated segment to the compute dtype on the host and copies it into the
#    device's weights — stage 3's weight shard, or this rank's rows of the full weights
#    that stages 1-2 all-gather after the step,
# 5. starts writing k back.
#
# Reads and writes run in order on one background thread (``os.preadv``/``os.pwritev`` and
# the kernel release the GIL) while the current sub-group steps, so the host holds two
# sub-groups of master and moments whatever the model's size, and a sub-group takes the
# longer of its step and the I/O beside it (one write and one read). The update is
# elementwise, and torch's fused kernel gives the same bits on any split of a tensor, so
# the result is ``AdamW(fused=True)``'s on the whole tensors, bit for bit.
# Hyper-parameters come from the user's optimizer's param groups at each step (LR
# schedulers keep working); its own ``step()`` then finds no gradient and does nothing.
# Its state holds the step counts and, as ``exp_avg``/``exp_avg_sq``, tensors over the
# files: its ``state_dict()`` reads them there.
# ----------------------------------------------------------------------------------------

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
        ranges = [(offset, offset + numel) for _, offset, numel in u.owned_rows()]
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


class DiskStep:
    """The streamed step over every disk unit of one model on this rank."""

    def __init__(self, units, sub_group_size: int):
        self.units = [u for u in units if u.disk is not None]
        self.groups = _cut(self.units, sub_group_size)
        self.group_numel = max((g[-1][3] + g[-1][2] - g[-1][1] for g in self.groups),
                               default=0)
        self.buffers: list[torch.Tensor] = []  # two [3, group_numel] fp32, from the first step
        # (unit, j) whose moments in the file are still the zeros written at zs.shard time
        self._zero = {(u.index, j) for u in self.units for j in range(len(u.owned_rows()))}
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
            m_views, v_views = u.slot_views(u.disk.planes[1]), u.slot_views(u.disk.planes[2])
            for j, (shard, start, _) in enumerate(u.owned_rows()):
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
        if any(shard.grad is not None for u in self.units for shard, _, _ in u.owned_rows()):
            for u in self.units:
                u.disk.drop_mapped()
            self._adopt_state(optimizer, group_of)
        for u in self.units:
            for j, (shard, _, _) in enumerate(u.owned_rows()):
                if shard.grad is not None and id(shard) in group_of:
                    active[(u.index, j)] = (group_of[id(shard)], optimizer.state[shard]["step"],
                                            shard.grad.reshape(-1), u.compute_rows(j))
        if active:
            # t <- t + 1 once per parameter, as the fused AdamW does, before any segment
            torch._foreach_add_([a[1] for a in active.values()], 1)
            self._stream(active)
        for u in self.units:  # this optimizer's: its own step() then finds nothing to do
            for shard, _, _ in u.owned_rows():
                if id(shard) in group_of:
                    shard.grad = None

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
            for j, (_, off, n) in enumerate(u.owned_rows()):
                hit = active.get((u.index, j))
                if hit is None:
                    continue
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


# ----------------------------------------------------------------------------------------
# AdamW for the host step of optimizer offload: torch's fused CPU kernel, plus the cast.
#
# When the optimizer is offloaded, the fp32 master weights and Adam's two moments live in
# host memory and the step runs on the CPU. That step is a pure stream over memory: per
# parameter it reads the weight, the gradient and both moments (4 x 4 bytes) and writes the
# weight and both moments back (3 x 4 bytes), 28 bytes, with a dozen flops in between. What
# decides its speed is therefore how close it gets to the memory bandwidth, and that is a
# question of the kernel, not of Python: torch ships a vectorised, OpenMP-parallel fused
# AdamW for CPU (``torch._fused_adamw_``, ``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``),
# which ``bench/host_adam.py`` measures at the speed of DeepSpeed's hand-written
# ``DeepSpeedCPUAdam`` and near this machine's bandwidth limit. ``HostAdamW`` calls that
# kernel, so its update is bit for bit the one of ``torch.optim.AdamW(fused=True)``; the
# state dict has torch's layout (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter) and
# loads into torch's AdamW and back.
#
# What it adds is the cast. Offload sends the updated weights back to the device in the
# compute dtype, so each master weight may be given an output tensor (bf16 or fp16) that
# every step refreshes with ``param.to(out.dtype)``, right after the update. torch has no
# kernel that updates and casts in one pass, so the cast is a second, multi-tensor pass
# (``torch._foreach_copy_``): 4 bytes read and 2 written per weight. Walking the update in
# cache-sized chunks, each cast right behind its chunk, was measured and gained at most 3 %:
# torch 2.13's fp32-to-bf16 conversion runs at 7-10 G elements/s per thread whether its
# input is in cache or not, so the cast costs its conversion, not its memory traffic.
# (One pass compiled by ``torch.compile`` stepped and cast 50 M weights 1.19x faster on one
# thread, but it rounds differently from torch's AdamW (a few thousand weights of a million
# differ after one step), compiles for ~20 s and needs a C++ compiler at run time; agreeing
# with torch's optimizer to the bit is worth more here: offload must be exact.)
#
# The update, per element with g the gradient, t the step count (torch's AdamW)::
#
#     p     <- p * (1 - lr * weight_decay)                 # decoupled weight decay
#     m     <- beta1 * m + (1 - beta1) * g
#     v     <- beta2 * v + (1 - beta2) * g^2
#     p     <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
# ----------------------------------------------------------------------------------------

#: dtypes a cast output may have: the compute dtypes of mixed precision
CAST_DTYPES = (torch.bfloat16, torch.float16)
#: group keys of torch's AdamW that describe what HostAdamW does, so that its state dict,
#: loaded into ``torch.optim.AdamW``, takes the same fused path and continues bit for bit
_TORCH_KEYS = dict(fused=True, foreach=None, capturable=False, differentiable=False,
                   decoupled_weight_decay=True)


def _check_number(name: str, value: Any, low: float, high: float | None = None) -> None:
    """ValueError unless ``low <= value`` (and ``value < high`` when high is given)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"HostAdamW: {name} must be a float, got {value!r}")
    if not (value >= low and (high is None or value < high)):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"HostAdamW: {name} must be {bound}, got {value!r}")


def _check_group(group: dict[str, Any]) -> None:
    """Refuse, by name, any hyper-parameter HostAdamW cannot apply exactly."""
    lr = group["lr"]
    if isinstance(lr, Tensor):
        if lr.numel() != 1 or lr.device.type != "cpu" or not lr.is_floating_point():
            raise ValueError("HostAdamW: a tensor lr must be one floating-point element on the "
                             f"CPU, got shape {tuple(lr.shape)} {lr.dtype} on {lr.device}")
    else:
        _check_number("lr", lr, 0.0)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"HostAdamW: betas must be a pair of floats, got {betas!r}")
    _check_number("betas[0]", betas[0], 0.0, 1.0)
    _check_number("betas[1]", betas[1], 0.0, 1.0)
    _check_number("eps", group["eps"], 0.0)
    _check_number("weight_decay", group["weight_decay"], 0.0)
    for flag in ("amsgrad", "maximize", "differentiable", "capturable"):
        if group.get(flag, False):
            raise NotImplementedError(f"HostAdamW: {flag}={group[flag]!r} is not supported; "
                                      f"accepted: {flag}=False")
    if not group.get("decoupled_weight_decay", True):  # a state dict saved by torch's Adam
        raise ValueError("HostAdamW: decoupled_weight_decay=False (Adam's coupled L2) is not "
                         "AdamW; accepted: decoupled_weight_decay=True")
    for p in group["params"]:
        if p.device.type != "cpu":
            raise ValueError(f"HostAdamW steps host tensors; got a parameter on {p.device} "
                             "(accepted: cpu)")
        if p.dtype != torch.float32:
            raise NotImplementedError(f"HostAdamW steps fp32 master weights; got a {p.dtype} "
                                      "parameter (accepted: torch.float32)")


class HostAdamW(torch.optim.Optimizer):
    """AdamW on host (CPU) fp32 parameters through torch's fused kernel, with the option to
    write each updated weight, cast to the compute dtype, into an output tensor.

    Args:
        params: parameters or param groups, as for any torch optimizer (fp32, on the CPU).
        lr: learning rate, a float or a one-element CPU tensor (changed in place between
            steps, as schedulers may do).
        betas: decay rates of the first and second moment averages.
        eps: added to the denominator, after the bias-corrected square root.
        weight_decay: decoupled weight decay coefficient (AdamW's, multiplied by lr).
        amsgrad, maximize: accepted only as False; True raises NotImplementedError.

    Cast outputs are registered per parameter with :meth:`set_cast_output`; they are not
    part of the state dict (they are buffers of whoever sends weights to the device).
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]],
                 lr: float | Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, amsgrad: bool = False,
                 maximize: bool = False) -> None:
        #: parameter -> the compute-dtype tensor each step refreshes with its cast
        self._cast_out: dict[Tensor, Tensor] = {}
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, **_TORCH_KEYS)
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled or deep-copied: torch's state, and no cast outputs (they are buffers of
        the engine that registered them, not state)."""
        super().__setstate__(state)
        self.__dict__.setdefault("_cast_out", {})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group as torch does, then refuse what the fused AdamW cannot do exactly."""
        super().add_param_group(param_group)
        try:
            _check_group(self.param_groups[-1])
        except (ValueError, NotImplementedError):
            self.param_groups.pop()
            raise

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of HostAdamW or of torch's AdamW (same layout); its groups are
        checked like new ones before anything is loaded."""
        for group in state_dict["param_groups"]:
            _check_group({**group, "params": []})
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.update(_TORCH_KEYS)  # what this optimizer does, whoever saved the file

    def set_cast_output(self, param: Tensor, out: Tensor) -> None:
        """From now on, every step writes ``param.to(out.dtype)`` into ``out``.

        ``out`` has the parameter's shape, a compute dtype (bf16 or fp16) and lives on the
        CPU (pinned memory, for a fast copy to the device, is the caller's choice). It is
        written at once, so it always holds the cast of the current weights.
        """
        if not any(param is p for g in self.param_groups for p in g["params"]):
            raise ValueError("HostAdamW.set_cast_output: the parameter is not in this "
                             "optimizer's param groups")
        if out.dtype not in CAST_DTYPES:
            raise ValueError(f"HostAdamW.set_cast_output: out has dtype {out.dtype}; "
                             f"accepted: {', '.join(str(d) for d in CAST_DTYPES)}")
        if out.shape != param.shape or out.device.type != "cpu":
            raise ValueError(f"HostAdamW.set_cast_output: out is {tuple(out.shape)} on "
                             f"{out.device}; accepted: the parameter's shape "
                             f"{tuple(param.shape)} on cpu")
        if not out.is_contiguous():
            raise ValueError("HostAdamW.set_cast_output: out must be contiguous")
        self._cast_out[param] = out
        with torch.no_grad():
            out.copy_(param)

    def remove_cast_output(self, param: Tensor) -> None:
        """Stop writing the parameter's cast (no error if none was set)."""
        self._cast_out.pop(param, None)

    @torch.no_grad()
    def write_cast_outputs(self) -> None:
        """Rewrite every cast output from its parameter (after weights changed outside a
        step, e.g. a checkpoint loaded into the master)."""
        for p, out in self._cast_out.items():
            out.copy_(p)

    def _state(self, p: Tensor) -> dict[str, Tensor]:
        """The parameter's state, created on first use exactly as torch's fused AdamW
        creates it (a float32 step counter on the CPU and two zero moments)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One AdamW update of every parameter that has a gradient, then the casts."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lists: list[list[Tensor]] = [[], [], [], [], []]  # params, grads, m, v, steps
            casts: list[list[Tensor]] = [[], []]  # outputs, their params
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise NotImplementedError("HostAdamW: sparse gradients are not supported")
                if p.grad.dtype != p.dtype or p.grad.device != p.device:
                    raise ValueError(f"HostAdamW: a gradient is {p.grad.dtype} on "
                                     f"{p.grad.device}; accepted: the parameter's "
                                     f"{p.dtype} on {p.device} (upcast it into p.grad)")
                state = self._state(p)
                for lst, t in zip(lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                                          state["step"])):
                    lst.append(t)
                out = self._cast_out.get(p)
                if out is not None:
                    casts[0].append(out)
                    casts[1].append(p)
            if not lists[0]:
                continue
            # t <- t + 1 first, as torch's fused AdamW does; the kernel reads t from them.
            torch._foreach_add_(lists[4], 1)
            beta1, beta2 = group["betas"]
            torch._fused_adamw_(*lists[:4], [], lists[4], lr=group["lr"], beta1=beta1,
                                beta2=beta2, weight_decay=group["weight_decay"],
                                eps=group["eps"], amsgrad=False, maximize=False)
            if casts[0]:
                torch._foreach_copy_(casts[0], casts[1])  # out <- param.to(out.dtype)
        return loss
