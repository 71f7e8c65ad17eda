"""Ranks out of step and ranks gone silent, named instead of waited out.

[Note: fingerprints] Every collective the engine issues is preceded, on a small group of
its own (``Collectives.control_group``), by an all-gather of a *fingerprint*: the
collective's sequence number, the optimizer step, the phase (forward, backward, step,
between steps), the kind, the unit and the element count. Fingerprints are all the same
shape, so the k-th of every rank always pair up, even when the collectives they describe
do not (ranks out of step issue unlike collectives, usually on different groups, which
would wait for each other until the timeout). Before a rank waits for a collective it
compares the fingerprints: a difference is one error on every rank, at once, naming what
each rank was doing. The exchange is issued beside the collective and cannot finish
later than it (both need every rank to have issued it), so checking it first costs no
wait of its own. ``ZeroConfig.check_collectives`` turns it off.

[Note: timeouts] A wait that runs past the process group's timeout means some rank never
issued the collective: frozen, killed, or busy outside the engine. The rank that timed
out writes where it is into the rendezvous store and gives the others a few seconds to
do the same; the ranks that never answer are the silent ones, and the error names them,
what this rank was waiting for and how to raise the timeout.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .cycle import PHASES

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "check", "owner_gather",
         "owner_scatter")
#: Fingerprint fields, in order (int64 each); ``value`` is ``agree``'s payload, the one
#: field ranks may differ in.
FIELDS = ("seq", "step", "phase", "kind", "unit", "numel", "value")
WIDTH = len(FIELDS)


class RanksOutOfStep(RuntimeError):
    """Ranks issued unlike collectives: their programs diverged."""


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the process group's timeout."""


def fingerprint(comm, kind: str, unit, numel: int, value: int = 0) -> torch.Tensor:
    """This rank's fingerprint of the collective it is about to issue."""
    first = unit[0] if isinstance(unit, (list, tuple)) else unit
    cycle = comm.cycle
    return torch.tensor([comm.seq, cycle.steps, PHASES.index(cycle.phase), KINDS.index(kind),
                         -1 if first is None else first, numel, value], dtype=torch.int64)


def describe(comm, row) -> str:
    """One fingerprint in words: "reduce_scatter of unit 3 (blocks.2) in the backward of
    step 5 (collective #41, 1,024 elements)"; steps count from 1."""
    seq, step, phase, kind, unit, numel, _ = (int(x) for x in row)
    what = KINDS[kind] if kind != KINDS.index("check") else "an agreement"
    if unit >= 0:
        name = comm.unit_names[unit] if unit < len(comm.unit_names) else "?"
        what += f" of unit {unit} ({name})"
    name = PHASES[phase]
    when = (f"in the {name} of step {step + 1}" if name in ("forward", "backward") else
            f"at optimizer step {step + 1}" if name == "step" else
            f"{name} (after step {step})" if step else name)
    size = f", {numel:,} elements" if numel else ""
    return f"{what} {when} (collective #{seq}{size})"

def check_fingerprints(comm, rows: torch.Tensor, mine: torch.Tensor) -> None:
    """Raise :class:`RanksOutOfStep` on every rank where the gathered fingerprints
    ``rows`` ([N, WIDTH]) differ in anything but ``value``."""
    same = (rows[:, :-1] == mine[:-1]).all().item()
    if same:
        return
    positions = "\n".join(f"  rank {r}: {describe(comm, row.tolist())}"
                          for r, row in enumerate(rows))
    hint = ""
    kinds = {int(k) for k in rows[:, 3]}
    if kinds == {KINDS.index("all_gather")} and len({int(u) for u in rows[:, 4]}) > 1:
        hint = ("\nRanks gathered different units. Ranks that run different modules (a "
                "mixture of experts routing per rank, a branch one rank skips) must gather "
                "the same units in the same order at stage 3: put the modules they run "
                "unevenly in one unit, the module that calls them (units=[that module, "
                "...], or units=None for the whole model), or use stage 2, which gathers "
                "nothing.")
    raise RanksOutOfStep(
        "ranks are out of step: the collectives they issued differ\n" + positions +
        "\nEvery rank must run the same sequence of forwards, backwards and steps (the "
        "same number of micro-batches, the same calls to clip_grad_norm_, state_dict "
        "and the like on every rank)." + hint)


def wait(work, comm, row: torch.Tensor | None) -> None:
    """``work.wait()``, with a timeout reported as :class:`CollectiveTimeout` naming the
    silent ranks and what this rank was waiting for (``row``: its fingerprint)."""
    try:
        work.wait()
    except RuntimeError as exc:
        if "imed out" not in str(exc) or isinstance(exc, (CollectiveTimeout, RanksOutOfStep)):
            raise
        raise CollectiveTimeout(_timeout_message(comm, row, exc)) from exc


def _timeout_message(comm, row, exc) -> str:
    waiting = describe(comm, row.tolist()) if row is not None else "a collective"
    timeout = comm.mesh.timeout_s
    silent, seen = _roll_call(comm, waiting, grace=min(5.0, max(1.0, (timeout or 10) / 2)))
    if silent is None:
        who = "the rendezvous store did not answer either (the rank hosting it, usually " \
              "rank 0, may be the silent one)"
    elif silent:
        who = (f"silent: rank{'s' if len(silent) > 1 else ''} "
               f"{', '.join(map(str, silent))} (frozen, killed, or busy outside the "
               "engine's collectives: a data loader, an evaluation, a debugger)")
    else:
        who = "every rank answered (they were all waiting; a rank issued fewer collectives)"
    others = "".join(f"\n  rank {r} was waiting for {w}" for r, w in sorted(seen.items())
                     if r != comm.mesh.dp_rank)
    limit = f"{timeout:g} s" if timeout else "the group's timeout"
    return (f"rank {comm.mesh.dp_rank} waited {limit} for {waiting}; {who}.{others}\n"
            f"If a rank is only slow (a long first compile, a slow filesystem), raise the "
            f"timeout: zs.init_distributed(timeout_s=...), zeroshard train --timeout "
            f"SECONDS, or \"timeout\" in the trainer's --config. ({exc})")


def _roll_call(comm, waiting: str, grace: float):
    """Write where this rank is into the store; wait up to ``grace`` seconds for the
    others. Returns (ranks that never answered, {rank: where}); (None, {}) when the store
    cannot be reached."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=grace))
        prefix = f"zeroshard/timeout/{comm.mesh.group_name}/"
        store.set(prefix + str(comm.mesh.global_rank), json.dumps(waiting))
        keys = {r: prefix + str(g) for r, g in enumerate(comm.mesh.global_ranks)}
        deadline = time.monotonic() + grace
        answered: set[int] = set()
        while True:
            answered |= {r for r, k in keys.items() if r not in answered and store.check([k])}
            if len(answered) == len(keys) or time.monotonic() >= deadline:
                break
            time.sleep(0.1)  # a failure path: poll the store gently
        seen = {r: json.loads(store.get(keys[r])) for r in answered}
    except (RuntimeError, ValueError, AttributeError):
        return None, {}
    return sorted(set(keys) - answered), seen
