"""Run as a torchrun script (``python -m zeroshard.train.launch --nproc-per-node 2
tests/engine/listeners.py``) or alone: joins the group as ``zeroshard train``'s ranks do and
prints, from rank 0, every address that this rank, the other ranks and the launcher
listen on (Linux: ``/proc``)."""

import json
import os
import socket
import struct

import torch.distributed as dist

from zeroshard.runtime.dist import init_distributed


def _inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def _address(hex_addr: str) -> str:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return f"{socket.inet_ntop(socket.AF_INET, raw[::-1])}:{int(port, 16)}"
    words = struct.unpack("<4I", raw)  # /proc prints each 32-bit word in host order
    return f"[{socket.inet_ntop(socket.AF_INET6, struct.pack('>4I', *words))}]:{int(port, 16)}"


def listening(pids) -> list[str]:
    """Addresses in LISTEN state (0A) held by the processes ``pids``."""
    inodes = set().union(*(_inodes(p) for p in pids))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:
                    found.append(_address(cols[1]))
    return found


if __name__ == "__main__":
    init_distributed(timeout_s=60)
    mine = [os.getpid()] + ([os.getppid()] if "TORCHELASTIC_RUN_ID" in os.environ else [])
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, listening(mine))
    if dist.get_rank() == 0:
        print(json.dumps(sorted({a for part in every for a in part})))
    dist.destroy_process_group()
