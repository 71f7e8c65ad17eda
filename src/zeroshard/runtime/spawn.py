"""Run one function on N local processes joined by a real process group.

Used by the tests, the demo and the benchmarks: each rank is a fresh process that joins
a gloo (CPU) or NCCL (CUDA) group through a file store, so no port can collide. The
ranks are forked from multiprocessing's fork server, which imports torch once (the
``forkserver`` start method with torch preloaded): each rank is still a new process
with nothing of the caller's state — a crash in one call cannot touch the next — but
starts in a fraction of a second instead of importing torch again (about 2 s of a core
per rank with the ``spawn`` method; the test suite spawns a few hundred ranks). A rank
that raises has its traceback reported; the other ranks, likely blocked in a collective
by then, are killed; and a group that does not finish within ``timeout`` seconds is
killed and reported instead of hanging.
"""

from __future__ import annotations

import codecs
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

#: Seconds to wait for other ranks' tracebacks once one rank has failed.
_GRACE = 3.0
#: What the fork server imports once, for every rank forked from it.
#: (torch._dynamo: every sharded model's hooks are marked for it, ``hooks.py``; it
#: starts no thread, and costs each rank half a second of a core when imported there.)
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "zeroshard.runtime.spawn",
            "zeroshard.runtime.dist"]


class RankFailure(RuntimeError):
    """One or more ranks raised, or the group ran past its timeout."""

    def __init__(self, message: str, tracebacks: dict[int, str]):
        super().__init__(message)
        self.tracebacks = tracebacks

    def one_line(self) -> str:
        """The failure in one line (a command's error line): the first failing rank's
        error, the last line of its traceback, rather than every rank's traceback."""
        if not self.tracebacks:
            return str(self)
        rank = min(self.tracebacks)
        last = [x for x in self.tracebacks[rank].strip().splitlines() if x.strip()][-1:]
        return (f"{len(self.tracebacks)} rank(s) failed; rank {rank}: "
                f"{last[0].strip() if last else 'no traceback'}")


def _worker(call, rank, world_size, store_path, backend, timeout, results, threads, outs):
    import torch
    import torch.distributed as dist

    from .dist import release_process_groups

    # A rank forked from the fork server holds the server's stdout and stderr, not the
    # caller's: it writes into files the caller copies out as they grow (``_Relay``).
    for fd, path in zip((1, 2), outs):
        sys.stdout.flush() if fd == 1 else sys.stderr.flush()
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), fd)
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        # Plain pickle copies tensors by value: the queue's default would pass shared
        # memory handles that die with this process.
        fn, args = pickle.loads(call)
        results.put(("ok", rank, pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put(("error", rank, traceback.format_exc()))
    finally:
        release_process_groups()


class _Relay:
    """The ranks' stdout and stderr, copied to the caller's as they grow: each rank writes
    into two files of its own (line by line; ``print`` in a rank shows in the caller's
    output, captured by pytest's ``capfd`` or ``capsys`` as from the caller)."""

    def __init__(self, folder: str, world_size: int):
        self.paths = [(os.path.join(folder, f"rank{r}.out"), os.path.join(folder, f"rank{r}.err"))
                      for r in range(world_size)]
        self._read = {p: 0 for pair in self.paths for p in pair}
        self._decode = {p: codecs.getincrementaldecoder("utf-8")("replace") for p in self._read}

    def copy(self) -> None:
        for (out, err) in self.paths:
            for path, stream in ((out, sys.stdout), (err, sys.stderr)):
                try:
                    with open(path, "rb") as f:
                        f.seek(self._read[path])
                        data = f.read()
                except FileNotFoundError:
                    continue
                if data:
                    self._read[path] += len(data)
                    stream.write(self._decode[path].decode(data))
                    stream.flush()


def spawn(fn: Callable, world_size: int, *args, backend: str = "gloo", timeout: float = 120.0,
          threads: int = 1) -> list:
    """Call ``fn(*args)`` on ``world_size`` ranks; return each rank's result, in rank order.

    ``fn`` must be importable by name (a module-level function) and its result picklable.
    Raises :class:`RankFailure` with every failing rank's traceback."""
    import multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ctx = mp.get_context("forkserver")
    # Takes effect when the server first starts; the server imports nothing that starts
    # threads or touches a device, so forking it is safe.
    ctx.set_forkserver_preload(_PRELOAD)
    tmp = tempfile.mkdtemp(prefix="zeroshard-spawn-")
    results = ctx.Queue()
    # The function and its arguments travel as plain pickle too: tensors by value, not as
    # shared-memory handles, whose file descriptors the fork server can pass only a few
    # hundred of at once.
    call = pickle.dumps((fn, args))
    relay = _Relay(tmp, world_size)
    procs = [
        ctx.Process(target=_worker, daemon=True,
                    args=(call, r, world_size, os.path.join(tmp, "store"), backend, timeout,
                          results, threads, relay.paths[r]))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) + len(errors) < world_size:
            now = time.monotonic()
            if errors and deadline > now + _GRACE:  # from the first failure on, a grace only
                deadline = now + _GRACE
            limit = deadline
            if now >= limit:
                break
            relay.copy()
            try:
                status, rank, payload = results.get(timeout=min(0.2, limit - now))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and p.exitcode not in (0, None)
                        and r not in outputs and r not in errors]
                for r in dead:  # killed by a signal or os._exit: nothing was reported
                    errors[r] = f"rank {r} exited with code {procs[r].exitcode} without reporting"
                continue
            if status == "ok":
                outputs[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        relay.copy()
        shutil.rmtree(tmp, ignore_errors=True)
    if errors:
        body = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise RankFailure(f"{len(errors)} of {world_size} ranks failed:\n{body}", errors)
    if len(outputs) < world_size:
        missing = sorted(set(range(world_size)) - set(outputs))
        raise RankFailure(f"ranks {missing} did not finish within {timeout:g} s", {})
    return [outputs[r] for r in range(world_size)]
