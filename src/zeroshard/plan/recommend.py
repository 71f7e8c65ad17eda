"""``zeroshard plan --recommend``: the configuration to run, and why.

``search.py`` finds every configuration that fits, each with the largest micro-batch
whose planned peak stays within the budget less the headroom, and its predicted step
time. The source documents' stage-selection guide is encoded as rules on top of that
ranking:

- **lowest stage first**: DDP if it fits, else ZeRO-1 or 2 (same traffic as DDP), else
  ZeRO-3 — a higher stage, deeper prefetch, larger TP degree or checkpointing is chosen
  only when it is more than :data:`TIE` faster than the simpler configuration;
- **one block per unit** unless coarser units are faster (the first source document:
  wrap per transformer block);
- **hybrid sharding only when it pays**: the group's gathers and reductions move to the
  fast link and only 1/K of the gradients crosses between groups, at the price of the
  stage's state over K instead of N (16P/K at stage 3); plain sharding over every rank
  is preferred unless the group is more than :data:`TIE` faster;
- **offload only when nothing else fits** (``plan/placement.py``; the source documents'
  "ZeRO-3 + offloading" for the largest models): if no configuration fits the device,
  the search runs again with the optimizer in host memory (stages 1-3), then with the
  weight shards there too (stage 3), and the ``offload`` reason says what it costs in
  time: PCIe copies on the compute path and the host step. With the optimizer placed
  on disk (the configuration's ``offload_dir``, or ``recommend``'s for an offload it
  falls back to; ``--offload-dir``) every offloaded configuration keeps the master and
  the states on disk: the device's bytes are the same, so the same ones fit; the
  reason adds the disk bytes and seconds of the streamed step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..spec.config import ZeroConfig
from .arch import ModelSpec
from .comm import uses_zeropp
from .hardware import Cluster
from .reasons import BLOCKS_PER_UNIT, PREFETCH, TIE, none_reason, offload_reason, reasons
from .search import HEADROOM, TP_DEGREES, Candidate, search, shard_groups

__all__ = ["BLOCKS_PER_UNIT", "HEADROOM", "PREFETCH", "TIE", "TP_DEGREES", "Candidate",
           "Recommendation", "choose", "recommend", "search", "shard_groups"]


@dataclass(frozen=True)
class Recommendation:
    """The chosen configuration, a reason per choice, and the runners-up."""

    best: Candidate | None
    """None when nothing fits; ``reasons["none"]`` says why."""
    reasons: dict[str, str] = field(default_factory=dict)
    """One sentence per choice: stage, tp, shard group, unit size, prefetch,
    checkpointing, micro-batch."""
    runners_up: tuple[Candidate, ...] = ()
    """The fastest configuration of each other (stage, tp, shard group, checkpointing),
    fastest first; the fastest of the other layout (hybrid when plain was chosen, and
    the reverse) is always among them."""
    budget: int = 0
    """GPU memory in bytes; configurations use at most (1 - headroom) of it."""
    headroom: float = HEADROOM
    """The fraction of ``budget`` left free."""
    notes: tuple[str, ...] = ()
    """What else to know that is no choice of the search."""

    def as_dict(self) -> dict:
        return {"best": self.best.as_dict() if self.best else None, "reasons": self.reasons,
                "runners_up": [c.as_dict() for c in self.runners_up], "budget": self.budget,
                "headroom": self.headroom, "notes": list(self.notes)}


def choose(found: list[Candidate]) -> Candidate:
    """The simplest candidate (by :attr:`Candidate.key`) within TIE of the fastest."""
    fastest = min(c.time.step for c in found)
    close = [c for c in found if c.time.step <= fastest * (1 + TIE)]
    return min(close, key=lambda c: c.key)


def _runners_up(found: list[Candidate], best: Candidate, count: int) -> tuple:
    """The fastest of each other (stage, tp, shard group, checkpointing), fastest first;
    the fastest of the other layout (hybrid or plain) joins them if it is not there."""
    group = lambda c: (c.stage, c.tp, c.shard_group, c.checkpointing)  # noqa: E731
    heads: dict[tuple, Candidate] = {}
    for c in sorted(found, key=lambda c: (c.time.step, c.key)):
        if group(c) != group(best):
            heads.setdefault(group(c), c)
    rows = list(heads.values())[:count]
    hybrid = best.shard_group is None
    other = [c for c in heads.values() if (c.shard_group is not None) == hybrid]
    if other and not any((c.shard_group is not None) == hybrid for c in rows):
        rows.append(other[0])
    return tuple(rows)


def recommend(model: ModelSpec, config: ZeroConfig, gpus: int, budget: int, cluster: Cluster,
              global_batch: int, seq_len: int, flash_attention: bool = False,
              tp: int | None = None, prefetch: int | None = None,
              runners_up: int = 5, headroom: float = HEADROOM, allow_offload: bool = True,
              offload_dir=None, checkpointing: str | None = None) -> Recommendation:
    """The recommended configuration for ``global_batch`` sequences of ``seq_len``,
    leaving ``headroom`` (a fraction) of each GPU's memory free. ``config`` gives the
    precision, a fixed shard group (``shard_group``: K, or ``"node"``: a node's
    data-parallel ranks; None: plain and groups of whole nodes are weighed) and an
    offload (only configurations with it, where it goes); its stage and prefetch are
    chosen. Without an offload in ``config`` (and with no fixed group, and
    ``allow_offload``) one is tried only when nothing fits without, placed at
    ``offload_dir`` (None: host memory; ``PLANNED_DISK`` or a folder: disk).
    ``checkpointing`` fixes the activation checkpointing (None: none, selective and full
    are weighed, the least recompute preferred within 1%)."""
    for name, v in (("gpus", gpus), ("global_batch", global_batch), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom={headroom!r} must be a fraction in [0, 1)")
    if uses_zeropp(config):
        raise NotImplementedError("recommend does not weigh hpZ or quantized collectives "
                                  "yet; plan them with plan_all and step_times")
    found, need, tps, groups = search(model, config, gpus, budget, cluster, global_batch,
                                      seq_len, flash_attention, tp, prefetch, headroom,
                                      checkpointing)
    device_need, offload_need = need, {}
    # offload when nothing fits on the device; a fixed shard group is told that a larger
    # group (or plain sharding) fits instead
    fallback = (not found and config.offload is None and config.shard_group is None
                and allow_offload)
    for more in ("optimizer", "params") if fallback else ():
        offloaded = replace(config, stage=3, offload=more, offload_dir=offload_dir)
        found, offload_need, tps, groups = search(model, offloaded, gpus, budget, cluster,
                                                  global_batch, seq_len, flash_attention,
                                                  tp, prefetch, headroom, checkpointing)
        if found:  # stage 0 cannot offload: its need stays the device's
            need = {**device_need, **offload_need}
            break
    limit = int(budget * (1 - headroom))
    dps = sorted({gpus // k for k in tps}, reverse=True)
    if all(global_batch % d for d in dps):
        raise ValueError(f"global batch of {global_batch} sequences does not divide over "
                         f"{' or '.join(map(str, dps))} data-parallel ranks")
    if not found:
        why = none_reason(model, config, gpus, cluster, limit, headroom, need, groups,
                          seq_len, flash_attention, offload_need)
        return Recommendation(None, {"none": why}, (), budget, headroom)
    best = choose(found)
    why = reasons(best, found, need, tps, groups, cluster, limit, global_batch,
                          seq_len, headroom)
    why["offload"] = offload_reason(best, device_need, limit, model, gpus, cluster,
                                    config.offload)
    return Recommendation(best, why, _runners_up(found, best, runners_up), budget, headroom)
