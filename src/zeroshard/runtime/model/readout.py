"""What a sharded model gives out besides its state dict (``dtensor.py``): its full
weights, and the bytes it holds and sends.
"""

from __future__ import annotations

import torch

from ..build.construct import broadcast_buffers
from ..unit.local import tp_dim
from ..unit.readout import disk_bytes, full_tensors, host_bytes, measure
from .dtensor import owners


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Full, unsharded weights (the fp32 master where there is one) and buffers under
    their original names. A collective: every rank must call it. With
    ``broadcast_buffers`` the buffers are rank 0's (broadcast first, as the next
    forward would), so every rank returns the same state."""
    model.synchronize()
    if model.zero_config.broadcast_buffers:
        broadcast_buffers(model.module, model.comm)
    values = {}
    for u in model.units:
        values.update(full_tensors(u))
        for i, p in enumerate(u.params):  # tensor parallelism's slices, whole
            d = tp_dim(p)
            if d is not None and model.mesh.tp_world > 1:
                values[u.names[i]] = model.comm.gather_tp(values[u.names[i]], d)
    by_id = owners(model)  # full parameters, and the DTensors released units show
    out = {}
    for key, t in model.module.state_dict(keep_vars=True).items():
        if id(t) in by_id:
            u, i = by_id[id(t)]
            out[key] = values[u.names[i]]
        else:
            out[key] = t.detach().clone()
    return out


def memory(model, optimizer=None, by_placement: bool = False) -> dict:
    """Bytes on this rank per category: params, grads, optimizer (master + state of
    ``optimizer``), padding, and the transient gathered and buffers. With
    ``by_placement``, ``{"device": {...}, "host": {...}, "disk": {...}}``: what
    offload keeps in host memory apart (``ZeroConfig.offload``), and what disk
    offload keeps in files (``ZeroConfig.offload_dir``; the host then holds the
    step's sub-group buffers)."""
    total = measure(model.units, optimizer)
    streamed = model.stepper.disk_step.buffer_bytes() if model.stepper.disk_step is not None else 0
    total["buffers"] += streamed  # disk offload's sub-group buffers, on the host
    if not by_placement:
        return total
    host, disk = dict.fromkeys(total, 0), dict.fromkeys(total, 0)
    host["buffers"] += streamed
    for u in model.units:
        for c, b in host_bytes(u, optimizer).items():
            host[c] += b
        for c, b in disk_bytes(u).items():
            disk[c] += b
    return {"device": {c: total[c] - host[c] - disk[c] for c in total}, "host": host,
            "disk": disk}

