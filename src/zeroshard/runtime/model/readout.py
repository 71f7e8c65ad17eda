"""What a sharded model gives out: its weights (the standard ``state_dict()`` /
``load_state_dict()``, full weights, ``gathered()``) and the bytes it holds and sends.

[Note: state dict] ``state_dict()`` returns what this rank holds, without a collective:
under each original name (tied names each, as torch does) the tensor the rank reads
and writes that parameter through (``Unit.held_rows``) — the fp32 master rows where
there is a master, else the weights — and the module's persistent buffers. At stages
1-3 a trainable parameter of d0 rows is rank r's dim-0 chunk, rows ``[r·c, r·c + c)``
with c = ceil(d0 / N) (``zeroshard.runtime.unit.layout.dim0_chunk``); at stage 0, and for a
frozen parameter below stage 3, the whole parameter. So ``torch.save`` of it on every
rank is a sharded checkpoint of the weights (FSDP2 returns sharded DTensors alike), and
nothing is gathered; ``full_state_dict()`` gathers the full weights, and
``zeroshard.save`` writes a resharding checkpoint with the optimizer state.

``load_state_dict()`` takes, per parameter, either this rank's rows (what
``state_dict()`` returned) or the full parameter (an unsharded model's state dict), checks
every shape before it writes anything, writes the master (or weights) and then brings
the compute weights up to date from it — a collective at stages 1-2, like the step.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch
from torch.nn.modules.module import _IncompatibleKeys

from ..build.construct import broadcast_buffers
from ..ledger import measure


def _by_param(model) -> dict[int, tuple]:
    return {id(p): (u, i) for u in model.units for i, p in enumerate(u.params)}


def _state_dict(model, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
    """This rank's rows of every parameter and the persistent buffers (see the note)."""
    out = OrderedDict() if destination is None else destination
    owners = _by_param(model)
    for key, t in model.module.state_dict(keep_vars=True).items():
        if id(t) in owners:
            u, i = owners[id(t)]
            t = u.held_rows(i)[0]
        out[prefix + key] = t if keep_vars else t.detach()
    return out


def _load_state_dict(model, values: dict, strict: bool = True) -> _IncompatibleKeys:
    """Write ``values`` (this rank's rows or full tensors, per key) into the shards."""
    expected = model.module.state_dict(keep_vars=True)
    missing = [k for k in expected if k not in values]
    unexpected = [k for k in values if k not in expected]
    if strict and (missing or unexpected):
        raise ValueError(f"load_state_dict: missing keys {missing}, unexpected keys "
                         f"{unexpected}; the keys are the module's own names (as "
                         "state_dict() returns them); strict=False loads the rest")
    owners = _by_param(model)
    writes = []
    for key, t in expected.items():
        if key not in values:
            continue
        value = torch.as_tensor(values[key])
        if id(t) not in owners:  # a buffer
            if value.shape != t.shape:
                raise ValueError(f"load_state_dict: buffer {key!r} has shape "
                                 f"{tuple(value.shape)}, the model's {tuple(t.shape)}")
            writes.append((t, value))
            continue
        u, i = owners[id(t)]
        target, first = u.held_rows(i)
        full = tuple(u.params[i].shape)
        if tuple(value.shape) == full:  # the full parameter: this rank's rows of it
            count = target.shape[0] if target.dim() else 1
            rows = value.reshape(full[0] if full else 1, -1)[first:first + count]
            writes.append((target, rows.reshape(target.shape)))
        elif value.shape == target.shape:
            writes.append((target, value))
        else:
            raise ValueError(
                f"load_state_dict: {key!r} has shape {tuple(value.shape)}; expected the full "
                f"parameter {full} or this rank's rows {tuple(target.shape)} (from row {first})")
    with torch.no_grad():
        for target, value in writes:
            target.copy_(value)
    model.refresh_compute()
    return _IncompatibleKeys(missing, unexpected)


class Readout:
    """Weights in and out, bytes held and sent (a mixin of ShardedModel)."""

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
        """This rank's rows of every parameter (the master where there is one) and the
        persistent buffers, under the module's own names; no collective
        (``runtime/state_dict.py``). ``full_state_dict()`` gathers full weights."""
        return _state_dict(self, destination, prefix, keep_vars)

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """Load this rank's rows, or full tensors, per key; master, shards and compute
        weights agree afterwards. Every rank calls it (a collective at stages 1-2)."""
        if assign:
            raise NotImplementedError("load_state_dict(assign=True) would replace the shards "
                                      "the optimizer holds; load with assign=False")
        return _load_state_dict(self, state_dict, strict)

    @contextlib.contextmanager
    def gathered(self):
        """Hold every unit's full weights for the context: forwards inside it (for
        example ``model.generate(...)``) issue no collective, so ranks may run different
        numbers of them. Entering is a collective (stage 3 gathers each unit once);
        the weights are released at exit. For inference: a backward inside is refused."""
        self.synchronize()
        held = [u for u in self.units if u.policy.shards_params]
        for u in held:
            u.gather()
        self._hold = True
        try:
            yield self
        finally:
            self._hold = False
            for u in held:
                u.release()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded weights (the fp32 master where there is one) and buffers under
        their original names. A collective: every rank must call it. With
        ``broadcast_buffers`` the buffers are rank 0's (broadcast first, as the next
        forward would), so every rank returns the same state."""
        self.synchronize()
        if self.zero_config.broadcast_buffers:
            broadcast_buffers(self.module, self.comm)
        values = {}
        for u in self.units:
            values.update(u.full_tensors())
        by_id = {id(p): values[n] for u in self.units for n, p in zip(u.names, u.params)}
        out = {}
        for key, t in self.module.state_dict(keep_vars=True).items():
            out[key] = by_id[id(t)] if id(t) in by_id else t.detach().clone()
        return out

    def memory(self, optimizer=None, by_placement: bool = False) -> dict:
        """Bytes on this rank per category: params, grads, optimizer (master + state of
        ``optimizer``), padding, and the transient gathered and buffers. With
        ``by_placement``, ``{"device": {...}, "host": {...}, "disk": {...}}``: what
        offload keeps in host memory apart (``ZeroConfig.offload``), and what disk
        offload keeps in files (``ZeroConfig.offload_dir``; the host then holds the
        step's sub-group buffers)."""
        total = measure(self.units, optimizer)
        streamed = self._disk_step.buffer_bytes() if self._disk_step is not None else 0
        total["buffers"] += streamed  # disk offload's sub-group buffers, on the host
        if not by_placement:
            return total
        host, disk = dict.fromkeys(total, 0), dict.fromkeys(total, 0)
        host["buffers"] += streamed
        for u in self.units:
            for c, b in u.host_bytes(optimizer).items():
                host[c] += b
            for c, b in u.disk_bytes().items():
                disk[c] += b
        return {"device": {c: total[c] - host[c] - disk[c] for c in total}, "host": host,
                "disk": disk}

    def comm_stats(self, reset: bool = False, by_level: bool = False) -> dict:
        """Per collective kind: calls and bytes this rank sent (ring accounting). With
        ``by_level``, per level first: ``"inside"`` the shard groups, ``"across"`` them
        (hybrid sharding's replica all-reduce), ``"control"`` (the engine's checks)."""
        stats = self.ledger.by_level() if by_level else self.ledger.comm_stats()
        if reset:
            self.ledger.reset()
        return stats

