"""Whether a run of ``zeroshard train`` fits this machine's memory, asked before launch.

``--batch 2000000000`` was accepted: each rank drew the global batch's window starts
(16 GB), grew for a minute printing nothing, and the out-of-memory killer's SIGKILL
was all the user learned. The planner (pure Python) knows the bytes of a rank's model
state and of its activations for a micro-batch; the trainer knows its token batches
(every rank draws the global batch's starts, then holds its rows). Their sum over the
``nproc`` processes, each with its interpreter and torch, is held against the memory
this machine has available. Every figure is a lower bound, so a run refused here could
not have fitted; one that passes may still be too large, and is then told as before.
"""

from __future__ import annotations

from .._host import PROCESS_BYTES, available_bytes, gb
from .settings import TrainConfig, processes

TOKEN = 8  # bytes of an int64 token id


def _planned(cfg: TrainConfig, source, micro: int) -> tuple[int, int]:
    """(model state, activations) bytes of one rank, as the planner counts them for the
    device the run computes on; (0, 0) where the planner cannot describe the model."""
    import torch

    from ..plan.arch import ModelSpec
    from ..plan.memory import plan_strategy
    from ..plan.workload import Workload
    from ..spec.dims import ParallelDims

    group = cfg.zero.shard_group
    shard = group if isinstance(group, int) and cfg.nproc % group == 0 else None
    try:
        arch = ModelSpec.from_arch(source.architecture())
        work = Workload.of_mode(micro * source.seq_len, source.seq_len,
                                cfg.zero.activation_checkpointing, flash_attention=True,
                                cpu=True)
        p = plan_strategy(arch, ParallelDims(cfg.nproc, shard=shard), cfg.zero, work)
    except Exception:  # noqa: BLE001 - a model the planner cannot describe: no lower bound
        return 0, 0
    if torch.cuda.is_available():  # the device's bytes are not this machine's memory
        return p.host, 0
    return p.weights + p.grads + p.optimizer + p.secondary + p.host, p.activations or 0


def _need(cfg: TrainConfig, source, batch: int) -> tuple[int, dict[str, int]]:
    """Bytes the run needs at global batch ``batch``: in all, and per process by part."""
    per_rank = batch // cfg.nproc
    micro = cfg.micro_batch or per_rank
    state, activations = _planned(cfg, source, micro)
    parts = {"token batches": TOKEN * (batch + per_rank * (source.seq_len + 1)),
             f"activations at {micro:,} sequences per micro-batch": activations,
             "model state": state}
    return cfg.nproc * (PROCESS_BYTES + sum(parts.values())), parts


def check(cfg: TrainConfig, source, spell=str) -> None:
    """A run whose processes cannot all fit the memory available here is refused, naming
    the setting to lower and how far (``spell``: a setting's name as the caller's user
    gives it)."""
    batch, nproc = spell("batch"), spell("nproc")
    have = available_bytes()
    if have is None:
        return
    need, parts = _need(cfg, source, cfg.batch)
    if need <= have:
        return
    each = ", ".join(f"{gb(v)} of {k}" for k, v in parts.items())
    step = cfg.nproc * (cfg.micro_batch or 1)  # the batches the settings accept
    least, _ = _need(cfg, source, step)
    if least > have:
        most = have // (least // cfg.nproc)
        way = f"{nproc}={most} is the most that fit" if most else "give a smaller model"
        raise ValueError(f"{nproc}={cfg.nproc} needs about {gb(need)} of this machine's memory "
                         f"({processes(cfg.nproc)}, each {each}), and {gb(least)} at the "
                         f"smallest batch; {gb(have)} is available: {way}")
    lo, hi = 1, cfg.batch // step  # need(lo * step) fits, need(hi * step) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _need(cfg, source, mid * step)[0] <= have else (lo, mid)
    raise ValueError(f"{batch}={cfg.batch} needs about {gb(need)} of this machine's memory "
                     f"({processes(cfg.nproc)}, each {each}); {gb(have)} is available: "
                     f"{batch}={lo * step} is the largest that fits")
