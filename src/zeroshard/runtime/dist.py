"""Process groups and devices: ``init_distributed``, ``release_process_groups`` and the
dtype names of recipes.
"""

from __future__ import annotations

import gc
import os
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

#: torch dtypes for the dtype names that ``zeroshard.spec.recipes`` uses.
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT); return ``(dp_rank, dp_world)``.

    gloo on CPU, nccl when CUDA is available (each process takes the GPU of its
    LOCAL_RANK). Without torchrun's variables it starts a group of one, so a script
    runs unchanged on a laptop. Where a torchrun agent hosts the store (its default),
    each attempt of the job keys the group in a namespace of its own (``attempt_store``),
    so workers that torchrun restarts always re-form it. Where MASTER_ADDR is a loopback
    address and no agent hosts the store, rank 0 serves the rendezvous store on
    loopback only; with a loopback MASTER_ADDR gloo is kept to the loopback interface.
    ``timeout_s`` bounds every wait in every group (the engine's groups inherit it).
    Calling it again is a no-op."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
            0 < timeout_s <= 1e9):
        raise ValueError(f"timeout_s={timeout_s!r}; expected a finite number of seconds > 0 "
                         "(at most 1e9)")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    _check_rank_environment()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is not supported; expected 'gloo' or 'nccl'")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "0")
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    timeout = timedelta(seconds=timeout_s)
    addr = os.environ.get("MASTER_ADDR", "")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ.get("MASTER_PORT", "0"))
    if is_loopback(addr) and loopback_interface() and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()  # gloo's sockets too
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        store = attempt_store(dist.TCPStore(addr, port, is_master=False, timeout=timeout),
                              rank, world, timeout)
    elif is_loopback(addr):
        # One machine: the store listens on loopback only (torch's own env://
        # rendezvous would listen on every interface).
        store = loopback_store(addr, port, rank, world, timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
        return dist.get_rank(), dist.get_world_size()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def _check_rank_environment() -> None:
    """The variables that make this process a rank of a job (torchrun's), checked before
    they are used: each named when it is missing, not a number or out of range, so
    leftovers from another launch are not a wait for ranks that never come."""
    env = os.environ
    if "RANK" not in env:
        return
    set_here = ", ".join(f"{k}={env[k]}" for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                     "MASTER_ADDR", "MASTER_PORT") if k in env)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        if key in env and not env[key].strip().isdigit():
            raise ValueError(f"{key}={env[key]!r} in the environment must be an integer")
    missing = [k for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing or not int(env["RANK"]) < int(env["WORLD_SIZE"]):
        problem = (f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set"
                   if missing else "RANK is not below WORLD_SIZE")
        raise ValueError(f"{set_here} in the environment make this process a rank of a job, "
                         f"but {problem}: start every rank with torchrun, or unset RANK and "
                         "WORLD_SIZE (left from an earlier launch?) for a group of one")


#: Where ``attempt_store`` keeps its keys in a torchrun agent's store.
_ATTEMPTS = "zeroshard/attempts"


def attempt_store(agent, rank: int, world: int, timeout: timedelta):
    """This attempt's namespace of the torchrun agent's store ``agent``: every worker of
    the attempt gets the same one, and no earlier attempt used it.

    [Note: restarts] torchrun's agent hosts the store its workers rendezvous in
    (``TORCHELASTIC_USE_AGENT_STORE=True``, the c10d backend's default since
    pytorch/pytorch#128096) and keeps it across restarts. torch keys the group in it
    under fixed names (``init_process_group``: ``PrefixStore("default_pg", store)``,
    ``torch/distributed/distributed_c10d.py``), so a restarted worker can read the
    address that a peer of the attempt before wrote there, connect to a dead socket,
    and fail or hang: the group re-forms only sometimes (pytorch/pytorch#135712).
    ``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt: each agent counts its own
    restarts, and a node restarted because another failed does not count
    (``torch/distributed/elastic/agent/server/api.py``, ``_invoke_run``), so nodes
    disagree. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` avoids it, but only when set where
    the agent starts, which a worker cannot do.

    So rank 0 draws a fresh random name and tells it to each other rank in answer to a
    fresh random question: rank r pushes a nonce onto a queue and waits for the key
    ``reply/<nonce>``, which nobody can have written before (a stale key cannot be
    read); rank 0 answers every nonce on the queue (stale ones from dead workers too,
    harmlessly) until every rank has counted itself in under the new name. Every
    worker of an attempt starts after every worker of the attempt before has been
    stopped (the agent stops its workers before it rendezvous again), so the name is
    this attempt's alone. The store stays the agent's, which outlives the workers (what
    #128096 shares it for)."""
    if rank == 0:
        name = uuid.uuid4().hex
        joined = f"{_ATTEMPTS}/{name}/joined"
        deadline = time.monotonic() + timeout.total_seconds()
        while world > 1 and agent.add(joined, 0) < world - 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 waited {timeout.total_seconds():g} s for "
                                   f"{world - 1 - agent.add(joined, 0)} of {world - 1} "
                                   "ranks to join the process group")
            try:
                nonce = agent.queue_pop(f"{_ATTEMPTS}/hello", block=False).decode()
            except dist.QueueEmptyError:
                time.sleep(0.02)
                continue
            agent.set(f"{_ATTEMPTS}/reply/{nonce}", name)
    else:
        nonce = uuid.uuid4().hex
        agent.queue_push(f"{_ATTEMPTS}/hello", nonce)
        agent.wait([f"{_ATTEMPTS}/reply/{nonce}"], timeout)
        name = agent.get(f"{_ATTEMPTS}/reply/{nonce}").decode()
        agent.delete_key(f"{_ATTEMPTS}/reply/{nonce}")
        agent.add(f"{_ATTEMPTS}/{name}/joined", 1)
    return dist.PrefixStore(f"{_ATTEMPTS}/{name}/", agent)


_LISTENERS: list = []  # sockets whose descriptors a store server listens on


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` names this machine's loopback interface."""
    import ipaddress

    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def loopback_store(addr: str, port: int, rank: int, world: int, timeout: timedelta):
    """The rendezvous store at ``addr:port`` on loopback: rank 0 serves it on a socket it
    binds to ``addr`` itself (torch's server would bind every interface), the others
    connect. ``port`` 0 (a world of one) picks a free port."""
    if rank != 0:
        return dist.TCPStore(addr, port, world, False, timeout)
    import socket

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1" if addr == "localhost" else addr, port))
    sock.listen(128)
    _LISTENERS.append(sock)  # the store holds the descriptor, not the object
    return dist.TCPStore(addr, sock.getsockname()[1], world, True, timeout,
                         master_listen_fd=sock.fileno(), use_libuv=True)


def loopback_interface() -> str | None:
    """The name of the loopback interface (``lo`` on Linux, ``lo0`` on macOS), for
    ``GLOO_SOCKET_IFNAME``; None where neither exists."""
    import socket

    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)


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


def default_device() -> torch.device:
    """The device this rank computes on: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def host_device() -> torch.device:
    """Where offloaded state lives: host memory (the CPU, even where it is the device)."""
    return torch.device("cpu")
