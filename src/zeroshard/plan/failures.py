"""What a failure costs a run that saves every ``n`` steps, and the save interval that
loses least to saves and failures together (``zeroshard plan --time/--recommend
--save-every --mtbf-hours``; docs/elastic.md). Pure Python, as the rest of the planner.

**A failure** (a rank killed, a node lost, a rank hung) costs, from the moment it
happens to the moment the run is back where it was (``zeroshard train --resume auto``
under torchrun ``--max-restarts``, docs/elastic.md):

- ``detect``: until the attempt ends. A dead rank's peers fail in their next collective
  (the connection closes) and torchrun's agent sees a worker exit within its monitor
  interval: seconds (:data:`DETECT_S`). A hung rank is found by the collective timeout
  (``zeroshard train --timeout``): give ``detect_s`` that.
- ``restart``: the agent stops every worker, rendezvous again and starts new ones, which
  import, join the process group and build the model (:data:`RESTART_S`).
- ``load``: the checkpoint read back, each of the ``writers`` ranks its share at the
  storage's ``bandwidth``: ``bytes / (writers · bandwidth)``.
- ``rework``: the steps since the last save, trained again. A failure lands at a uniform
  moment of the interval, so on average half of it: ``n · t / 2`` for steps of ``t``
  seconds.

**Saving** blocks training for ``C = bytes / (writers · bandwidth)`` every ``n`` steps,
a share ``C / (n · t)`` of the run.

**The interval** (Young, "A first order approximation to the optimum checkpoint interval",
CACM 17(9), 1974): with a failure every ``M`` seconds on average, the time lost per
second of work is ``C / τ + (detect + restart + load + τ / 2) / M`` for saves ``τ``
seconds apart; its minimum is at ``τ = sqrt(2 · C · M)``. Daly ("A higher order estimate
of the optimum checkpoint interval for restart dumps", FGCS 22(3), 2006) refines it for
saves that are not short beside ``M``: ``τ = sqrt(2CM) · (1 + sqrt(C / 2M) / 3 + (C / 2M)
/ 9) − C`` while ``C < 2M``, else ``τ = M``. :func:`best_save_every` takes Daly's ``τ``
in whole steps.

The checkpoint is what ``zeroshard train`` writes (``checkpoint/savedir.py``'s
``checkpoint_bytes``, held equal by ``tests/plan/test_failures.py``): the fp32 master
rows (the weights where there is no master) and the optimizer state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..spec.recipes import Recipe

#: Seconds from a rank's death to the end of the attempt: its peers' next collective
#: fails at once (the connection closes) and torchrun's agent polls its workers every
#: 0.1 s; a few seconds for the failing ranks to exit (measured: docs/elastic.md).
DETECT_S = 5.0
#: Seconds from the end of an attempt to the ranks training again, the checkpoint's read
#: aside: workers stopped, the rendezvous, new processes importing torch, the process
#: group and the model built. 10-25 s measured on the CPUs of docs/elastic.md; CUDA and
#: NCCL start-up on a GPU cluster add to it, so a minute is assumed.
RESTART_S = 60.0


def checkpoint_bytes(params: int, recipe: Recipe) -> int:
    """Bytes of one ``zeroshard train`` checkpoint of ``params`` parameters: the master
    rows (the weights without a master) and the optimizer state."""
    master = recipe.master_bytes or recipe.weight_bytes
    return params * (master + recipe.optimizer_bytes - recipe.master_bytes)


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} must be a positive number")


def io_seconds(nbytes: float, writers: int, bandwidth: float) -> float:
    """Seconds to write (or read) ``nbytes`` split over ``writers`` ranks, each at
    ``bandwidth`` bytes/s."""
    _positive("writers", writers)
    _positive("bandwidth", bandwidth)
    return nbytes / (writers * bandwidth)


@dataclass(frozen=True)
class RestartCost:
    """What saving every ``save_every`` steps and one failure cost, in seconds."""

    save_every: int
    """Steps between checkpoints."""
    step_s: float
    """Seconds per optimizer step."""
    save_s: float
    """Seconds one save blocks training."""
    detect_s: float = DETECT_S
    """From the failure to the end of the attempt."""
    restart_s: float = RESTART_S
    """From the end of the attempt to the ranks built again (the load aside)."""
    load_s: float = 0.0
    """Reading the checkpoint back."""

    def __post_init__(self) -> None:
        for name in ("save_every", "step_s"):
            _positive(name, getattr(self, name))
        for name in ("save_s", "detect_s", "restart_s", "load_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name}={value!r} must be a number >= 0")

    @property
    def rework_s(self) -> float:
        """The steps since the last save, on average half an interval."""
        return self.save_every * self.step_s / 2

    @property
    def per_failure_s(self) -> float:
        """Expected seconds one failure takes from the run."""
        return self.detect_s + self.restart_s + self.load_s + self.rework_s

    @property
    def save_share(self) -> float:
        """The share of the run spent saving."""
        return self.save_s / (self.save_every * self.step_s)

    def lost_share(self, mtbf_s: float) -> float:
        """The share of the run lost to saves and failures with a failure every
        ``mtbf_s`` seconds (Young's first-order sum)."""
        _positive("mtbf_s", mtbf_s)
        return self.save_share + self.per_failure_s / mtbf_s

    def as_dict(self) -> dict:
        return {"save_every": self.save_every, "step_s": self.step_s, "save_s": self.save_s,
                "detect_s": self.detect_s, "restart_s": self.restart_s,
                "load_s": self.load_s, "rework_s": self.rework_s,
                "per_failure_s": self.per_failure_s, "save_share": self.save_share}


def restart_cost(save_every: int, step_s: float, nbytes: float, writers: int,
                 bandwidth: float, detect_s: float = DETECT_S,
                 restart_s: float = RESTART_S) -> RestartCost:
    """The cost of saving ``nbytes`` every ``save_every`` steps of ``step_s`` seconds,
    written and read back by ``writers`` ranks at ``bandwidth`` bytes/s each."""
    io = io_seconds(nbytes, writers, bandwidth)
    return RestartCost(save_every, step_s, io, detect_s, restart_s, io)


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young's seconds between saves: ``sqrt(2 · C · M)``."""
    _positive("mtbf_s", mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's seconds of work between saves: Young's, corrected for saves that are not
    short beside the time between failures."""
    _positive("mtbf_s", mtbf_s)
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    r = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - save_s


def best_save_every(step_s: float, save_s: float, mtbf_s: float) -> int:
    """Daly's interval in whole steps of ``step_s`` seconds (at least 1)."""
    _positive("step_s", step_s)
    return max(1, round(daly_interval(save_s, mtbf_s) / step_s))


def describe(cost: RestartCost, mtbf_s: float | None = None, what: str = "") -> str:
    """One sentence: what a failure costs at ``cost``'s interval, and with ``mtbf_s`` the
    share lost and Daly's interval."""
    text = (f"restarts{what}: a failure costs {cost.per_failure_s:,.0f} s (detect "
            f"{cost.detect_s:g} s, restart {cost.restart_s:g} s, load {cost.load_s:.1f} s, "
            f"{cost.save_every / 2:g} steps since the last save {cost.rework_s:,.1f} s); a "
            f"save takes {cost.save_s:.1f} s every {cost.save_every} steps "
            f"({cost.save_share:.2%} of the run)")
    if mtbf_s is not None:
        best = best_save_every(cost.step_s, cost.save_s, mtbf_s)
        at_best = RestartCost(best, cost.step_s, cost.save_s, cost.detect_s, cost.restart_s,
                              cost.load_s)
        text += (f"; with a failure every {mtbf_s / 3600:g} h {cost.lost_share(mtbf_s):.2%} "
                 f"of the run is lost, {at_best.lost_share(mtbf_s):.2%} saving every {best} "
                 f"steps (Daly's interval; Young's sqrt(2 x {cost.save_s:.1f} s x "
                 f"{mtbf_s / 3600:g} h) = {young_interval(cost.save_s, mtbf_s) / 60:,.1f} min)")
    return text


def plan_restarts(step_s: float, nbytes: float, writers: int, bandwidth: float,
                  save_every: int | None = None, mtbf_s: float | None = None,
                  restart_s: float = RESTART_S, what: str = "") -> tuple[RestartCost, str]:
    """The cost at ``save_every``, or without it at Daly's interval for ``mtbf_s`` (one of
    them is needed), and :func:`describe`'s sentence."""
    if save_every is None:
        if mtbf_s is None:
            raise ValueError("give save_every or mtbf_s: the interval, or the failure rate "
                             "that chooses it")
        save_every = best_save_every(step_s, io_seconds(nbytes, writers, bandwidth), mtbf_s)
    cost = restart_cost(save_every, step_s, nbytes, writers, bandwidth, restart_s=restart_s)
    return cost, describe(cost, mtbf_s, what)
