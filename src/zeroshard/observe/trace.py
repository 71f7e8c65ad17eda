"""Exports of a profile: a Chrome/Perfetto trace and the unit lifetime chart."""

from __future__ import annotations

import json

from .profiler import Profiler

_CATEGORIES = ("params", "grads", "optimizer", "padding", "gathered", "buffers", "activations")
_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#8C8C8C", "#C44E52", "#8172B3", "#CCB974")


def _spans(prof: Profiler, begin: str, end: str) -> list[tuple[int, float, float]]:
    """(unit, start, stop) for each begin event matched with the unit's next end event."""
    open_, out = {}, []
    for e in prof.events:
        if e.kind == begin and e.unit not in open_:
            open_[e.unit] = e.t
        elif e.kind == end and e.unit in open_:
            out.append((e.unit, open_.pop(e.unit), e.t))
    return out


def param_lifetimes(prof: Profiler):
    """When each unit's full parameters are alive: gathered until released (stage 3);
    units that are never released are alive throughout."""
    spans = _spans(prof, "gather_done", "release")
    end = prof.events[-1].t if prof.events else 0.0
    released = {u for u, _, _ in spans}
    always = [u.index for u in prof.model.units
              if not u.policy.shards_params and u.index not in released]
    return spans + [(u, 0.0, end) for u in always]


def grad_lifetimes(prof: Profiler):
    """When each unit's full gradients are alive: from its backward to the reduction
    that frees them (stages 2-3), or to the optimizer step (stages 0-1)."""
    freed = not prof.model.policy.keeps_full_grads
    return _spans(prof, "backward_begin", "reduce_issued" if freed else "step_end")


def chrome_trace(prof: Profiler, path: str, rank: int = 0) -> None:
    """Write a Chrome/Perfetto trace: compute spans, communication spans, and one counter
    track per memory category (MB). Open it at ui.perfetto.dev or chrome://tracing."""
    us = 1e6
    ev = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}]
    for tid, name in ((0, "compute"), (1, "communication")):
        ev.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                   "args": {"name": name}})
    for phase in ("forward", "backward"):
        for unit, a, b in _spans(prof, f"{phase}_begin", f"{phase}_end"):
            ev.append({"name": f"unit {unit} {phase}", "ph": "X", "pid": rank, "tid": 0,
                       "ts": a * us, "dur": (b - a) * us})
    for c in prof.collectives:
        if "done" not in c:
            continue
        a, b = c["issued"] - prof.t0, c["done"] - prof.t0
        ev.append({"name": f"{c['kind']} unit {c['unit']}", "ph": "X", "pid": rank, "tid": 1,
                   "ts": a * us, "dur": (b - a) * us,
                   "args": {"bytes": c["bytes"], "waited_us": c.get("waited", 0.0) * us}})
    for e in prof.events:
        ev.append({"name": "memory (MB)", "ph": "C", "pid": rank, "ts": e.t * us,
                   "args": {k: e.memory[k] / 1e6 for k in _CATEGORIES}})
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"traceEvents": ev, "displayTimeUnit": "ms"}, fh)


def lifetime_chart(prof: Profiler, path: str, title: str = "") -> None:
    """One row per unit with its full parameters (and full gradients) alive, the memory
    by category stacked underneath, and the peak marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    units = [u.index for u in prof.model.units]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 2 + 0.45 * len(units) + 3),
                                      sharex=True,
                                      gridspec_kw={"height_ratios": [len(units) + 1, 4]})
    ms = 1e3
    for unit, a, b in param_lifetimes(prof):
        top.barh(unit + 0.18, (b - a) * ms, left=a * ms, height=0.34, color="#4C72B0")
    for unit, a, b in grad_lifetimes(prof):
        top.barh(unit - 0.18, (b - a) * ms, left=a * ms, height=0.34, color="#DD8452")
    top.set_yticks(units, [f"unit {u}" for u in units])
    top.invert_yaxis()
    top.legend(handles=[plt.Rectangle((0, 0), 1, 1, color="#4C72B0"),
                        plt.Rectangle((0, 0), 1, 1, color="#DD8452")],
               labels=["full parameters alive", "full gradients alive"], fontsize=8,
               loc="lower right")
    top.set_title(title or "unit lifetimes and memory", fontsize=10)
    t = [e.t * ms for e in prof.events]
    stacks = [[e.memory[k] / 1e6 for e in prof.events] for k in _CATEGORIES]
    bottom.stackplot(t, stacks, labels=_CATEGORIES, colors=_COLORS, step="post")
    k, peak = prof.peak()
    bottom.axvline(peak.t * ms, color="black", linestyle="--", linewidth=1)
    bottom.annotate(f"peak {prof.total(peak) / 1e6:.3f} MB\n{prof.phase_at(k)}",
                    (peak.t * ms, prof.total(peak) / 1e6), fontsize=8,
                    xytext=(5, -25), textcoords="offset points")
    bottom.set_xlabel("ms")
    bottom.set_ylabel("MB on this rank")
    bottom.legend(fontsize=7, loc="upper right", ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
