"""The environment another launcher left behind, checked before it decides how a run of
``zeroshard train`` starts.

``RANK`` and ``WORLD_SIZE`` make the command one rank of a job (as torchrun starts it)
rather than the launcher of ``--nproc`` processes. Left in a shell from an earlier
``torchrun`` or a script, they made it wait for ``MASTER_ADDR``, then, given one, for
the other ranks for five minutes, with no word of why. torchrun marks the processes it
starts (``TORCHELASTIC_RUN_ID``); without that mark the variables are named and the run
is refused at once. ``GLOO_SOCKET_IFNAME`` naming no interface of this machine is
refused here too, rather than as gloo's error inside every rank.
"""

from __future__ import annotations

import os

#: What torchrun's agent sets in every process it starts.
TORCHRUN_MARK = "TORCHELASTIC_RUN_ID"

#: The variables that make a process a rank of a job, and where it meets the others.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def left_by_a_launcher() -> str:
    """``RANK=0, WORLD_SIZE=2, ...``: the rank variables set in this environment."""
    return ", ".join(f"{k}={os.environ[k]}" for k in RANK_VARIABLES if k in os.environ)


def check(on_a_rank: bool) -> None:
    """Refuse a run that leftover variables would make one rank of a job nobody started;
    and a gloo interface this machine does not have."""
    if on_a_rank and TORCHRUN_MARK not in os.environ:
        world = os.environ.get("WORLD_SIZE", "?")
        raise ValueError(
            f"{left_by_a_launcher()} in the environment make zeroshard train one rank of a "
            f"job of {world}, but no torchrun started it (no {TORCHRUN_MARK}): left from an "
            "earlier launch? Unset RANK and WORLD_SIZE to launch --nproc processes here, or "
            "start every rank with torchrun")
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname:
        import socket

        have = sorted(name for _, name in socket.if_nameindex())
        missing = [n for n in ifname.split(",") if n not in have]
        if missing:
            raise ValueError(f"GLOO_SOCKET_IFNAME={ifname} in the environment names no network "
                             f"interface of this machine ({missing[0]}); expected one of "
                             f"{', '.join(have)}, or unset it")
