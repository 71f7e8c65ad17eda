"""Process groups and devices: ``init_distributed``, ``release_process_groups`` and the
dtype names of recipes."""

from __future__ import annotations

import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist

#: torch dtypes for the dtype names that ``zeroshard.plan.recipes`` uses.
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT); return ``(dp_rank, dp_world)``.

    gloo on CPU, nccl when CUDA is available (each process takes the GPU of its
    LOCAL_RANK). Without torchrun's variables it starts a group of one, so a script
    runs unchanged on a laptop. Calling it again is a no-op."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is not supported; expected 'gloo' or 'nccl'")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def release_process_groups() -> None:
    """Destroy the process groups while the interpreter is fully alive, after whatever
    still holds them. A sharded model is freed by the cycle collector (module hooks refer
    back to it), so collect first; otherwise its groups could be destructed during
    interpreter teardown, where gloo's worker threads may abort the process
    (pytorch/pytorch#179291). A caller handling an exception clears its traceback's
    frames first: they hold the model too."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_device() -> torch.device:
    """The device this rank computes on: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
