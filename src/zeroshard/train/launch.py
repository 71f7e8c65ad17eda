"""The local launcher of ``zeroshard train``: PyTorch's own (``torch.distributed.run``),
with a rendezvous whose store listens on the loopback interface only.

torchrun's rendezvous backends (``c10d``, ``static``) serve their store on every
interface, so on a shared machine anyone who can reach it could join or disturb the run.
For N processes on one machine nothing needs to: the ``zeroshard-loopback`` backend
below is torch's static rendezvous with its store served on a socket bound to
127.0.0.1, and the workers' gloo sockets are kept to the loopback interface
(``GLOO_SOCKET_IFNAME``). Runs over several machines go through ``torchrun`` as usual
(README: what listens where).

    python -m zeroshard.train.launch --nproc-per-node N -m zeroshard train
"""

from __future__ import annotations

import os
import signal
import sys

BACKEND = "zeroshard-loopback"

#: Seconds a rank stopped for a restart has between SIGTERM and SIGKILL.
STOP_GRACE_S = 5


def _stop_soon() -> None:
    """Stop the other ranks of a failed attempt within ``STOP_GRACE_S``. torch's agent
    gives them 30 s, whatever its ``--shutdown-timeout``: the process context closes the
    rest when one fails with ``close()``'s default (``SubprocessContext._poll``,
    torch/distributed/elastic/multiprocessing/api.py), and a restart stops them with
    ``_shutdown()``'s (``LocalElasticAgent._stop_workers``,
    torch/distributed/elastic/agent/server/local_elastic_agent.py). A rank of ``zeroshard
    train`` handles no SIGTERM (it dies at once), but a frozen one (SIGSTOP) never sees
    it: the wait only delays the restart. Ctrl-C's shutdown passes its own timeout."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext

    close = PContext.close

    def close_soon(self, death_sig=None, timeout: int = STOP_GRACE_S) -> None:
        close(self, death_sig, timeout)

    def stop_soon(self, worker_group) -> None:
        self._shutdown(timeout=STOP_GRACE_S)

    PContext.close, LocalElasticAgent._stop_workers = close_soon, stop_soon


def _restart_only_what_restarts_cure(folder: str) -> None:
    """A failed attempt is restarted only when a restart may cure it. torch's agent
    restarts every failure while restarts are left (``_invoke_run`` in
    ``torch/distributed/elastic/agent/server/api.py``); a rank that recorded bad input or
    a refused combination (``failure.incurable``) would meet it again each time, so the
    agent is told no restarts are left and the run ends with that line at once."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from . import failure

    monitor = LocalElasticAgent._monitor_workers

    def monitor_once(self, worker_group):
        result = monitor(self, worker_group)
        if result.state == WorkerState.FAILED and failure.incurable(folder) is not None:
            self._remaining_restarts = 0
        return result

    LocalElasticAgent._monitor_workers = monitor_once


def _create_handler(params):
    from torch.distributed.elastic.rendezvous import (
        RendezvousInfo,
        RendezvousStoreInfo,
    )
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    from ..runtime.dist import loopback_store

    class LoopbackRendezvous(StaticTCPRendezvous):
        """One node: the agent serves the store on 127.0.0.1 and its workers join it."""

        def next_rendezvous(self) -> RendezvousInfo:
            from torch.distributed import PrefixStore

            if not self._store:
                self._store = loopback_store("127.0.0.1", 0, 0, self.world_size, self.timeout)
                self.master_port = self._store.port
            store = PrefixStore(self.run_id, self._store)
            return RendezvousInfo(store, 0, self.world_size,
                                  RendezvousStoreInfo("127.0.0.1", self.master_port))

        def get_backend(self) -> str:
            return BACKEND

    return LoopbackRendezvous("127.0.0.1", 0, 0, 1, params.run_id, 600)


def main(argv: list[str]) -> int:
    """``torch.distributed.run`` on one node with the loopback rendezvous; a failed run is
    the first failing rank's one line and exit code (``train/failure.py``), not the
    launcher's report, unless debugging."""
    import logging
    import shutil
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.run import main as torchrun

    from ..runtime.dist import loopback_interface
    from . import failure

    rendezvous_handler_registry.register(BACKEND, _create_handler)
    _stop_soon()
    if loopback_interface() and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    debug = failure.debugging()
    if not debug:  # the agent's own warnings (SIGTERM sent to the other ranks, ...)
        logging.disable(logging.CRITICAL)
    folder = tempfile.mkdtemp(prefix="zeroshard-errors-")
    os.environ[failure.ERROR_DIR] = folder  # the workers inherit the agent's environment
    _restart_only_what_restarts_cure(folder)
    try:
        torchrun(["--nnodes", "1", "--rdzv-backend", BACKEND, "--rdzv-endpoint",
                  "127.0.0.1:0", *argv])
        return 0
    except ChildFailedError as exc:
        if debug:
            sys.stderr.write(exc.format_msg() + "\n")
        first, _ = exc.get_first_failure()
        seen = {r: (f.exitcode, f.signal_name() if f.exitcode < 0 else "")
                for r, f in exc.failures.items()}
        line, code = failure.told(folder, seen, first)
        sys.stderr.write(line + "\n")
        return code
    except SignalException as exc:  # Ctrl-C (or a kill): torch's agent has stopped the ranks
        if debug:
            raise
        sys.stderr.write(f"zeroshard train: stopped by {signal.Signals(exc.sigval).name}; "
                         "checkpoints saved before it are complete\n")
        return 128 + int(exc.sigval)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _from_pipe(fd: int) -> int:
    """Started early by the command (``early.py``): import what :func:`main` needs while
    the command checks its flags, then run what it hands over through pipe ``fd``
    (nothing: exit quietly)."""
    import torch.distributed.run  # noqa: F401
    from torch.distributed.elastic.agent.server import local_elastic_agent  # noqa: F401
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous  # noqa: F401

    from . import early

    run = early.wait_for_run(fd)
    if run is None:
        return 0
    argv, env = run
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # ignored until now
    return main(argv)


if __name__ == "__main__":
    from .early import WAIT_FLAG

    early_run = sys.argv[1:2] == [WAIT_FLAG]
    sys.exit(_from_pipe(int(sys.argv[2])) if early_run else main(sys.argv[1:]))
