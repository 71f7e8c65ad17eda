"""Bytes a sharded model holds on this rank, by ledger category, read off the tensors
the engine actually allocated (see ``zeroshard.observe.ledger`` for the categories)."""

from __future__ import annotations

from collections import Counter

from .ledger import CATEGORIES, optimizer_state_bytes, tensor_bytes


def measure(units, optimizer=None) -> dict[str, int]:
    """``{category: bytes}`` for this rank's units."""
    out: Counter[str] = Counter({c: 0 for c in CATEGORIES})
    transient: dict[int, object] = {}  # communication buffers, shared by bucketed units
    for u in units:
        stage = u.stage
        r = u.rank
        w_item = u.compute_dtype.itemsize
        # weights: full (padded storage) below stage 3, the slot at stage 3
        if stage == 3:
            out["params"] += u.w_layout.real_numel(r) * w_item
            out["padding"] += (u.w_layout.slot_numel - u.w_layout.real_numel(r)) * w_item
            if u.state.value == "gathered":
                out["gathered"] += sum(tensor_bytes(b) for b in u.padded)
        else:
            out["params"] += u.w_layout.numel * w_item
            out["padding"] += sum(tensor_bytes(b) for b in u.padded) - u.w_layout.numel * w_item
        # gradients: full below stage 2 (a transient reduced shard at stage 1), shard after
        g_real, g_slot = u.g_layout.real_numel(r), u.g_layout.slot_numel
        if stage <= 1:
            for i in u.trainable:
                g = u.params[i].grad
                if g is None and stage == 0 and u.master is None:
                    g = u.shards[i].grad  # after the step: a view of them, until zero_grad()
                out["grads"] += tensor_bytes(g) if g is not None else 0
            if u.grad_shard is not None:
                out["buffers"] += tensor_bytes(u.grad_shard)
        elif u.grad_shard is not None:  # between a cycle's first reduction and its step
            out["grads"] += g_real * u.grad_dtype.itemsize
            out["padding"] += (g_slot - g_real) * u.grad_dtype.itemsize
        # optimizer: master slot plus per-element state
        if u.master is not None:
            out["optimizer"] += g_real * u.master_dtype.itemsize
            out["padding"] += (g_slot - g_real) * u.master_dtype.itemsize
            if stage == 0:  # fp32 copies of the full gradients for the master step
                out["buffers"] += sum(tensor_bytes(u.shards[i].grad) for i in u.trainable
                                      if u.shards[i].grad is not None)
        out["optimizer"] += optimizer_state_bytes(optimizer, u.shards)
        if u.step_grads is not None and u.step_grads is not u.grad_shard:
            out["buffers"] += tensor_bytes(u.step_grads)
        for pending in (u._in_flight, u._sync_work, u._gather_work):
            if pending is not None:
                transient.update({id(t._base if t._base is not None else t): t
                                  for t in pending[1:]})
    out["buffers"] += sum(tensor_bytes(t if t._base is None else t._base)
                          for t in transient.values())
    return dict(out)
