"""The certificate a parity check returns: per category the largest difference and its
verdict, the run's memory by category against the planner's, its traffic per step
against the plan; printed as tables, and as JSON-ready data."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from .verdict import BITWISE, DIFFERS, ROUNDING, Difference

MB = 1e6
_STYLE = {BITWISE: "green", ROUNDING: "green", DIFFERS: "bold red"}


@dataclass
class Certificate:
    """What ``zs.verify`` and ``zeroshard verify`` found."""

    verdict: str
    """``bitwise``, ``within rounding`` or ``DIFFERS`` (the worst category's)."""
    rows: list[Difference]
    """Per category, in order: initial weights, losses, gradients of step 1, weights,
    each optimizer state."""
    title: str
    """The configuration checked, in words."""
    reference: str
    """What the reference ran, in words."""
    memory: dict = field(default_factory=dict)
    """Category -> (measured bytes on rank 0 by the ledger, planned bytes or None)."""
    comm: dict = field(default_factory=dict)
    """``{"measured": bytes sent per step by rank 0, "planned": bytes or None}``."""
    notes: list[str] = field(default_factory=list)
    """What the check changed or could not check (dropout turned off...)."""

    @property
    def ok(self) -> bool:
        """Whether the sharded run computes what the unsharded model computes."""
        return self.verdict != DIFFERS

    @property
    def first_difference(self) -> Difference | None:
        """Where the computation first departs, or None where nothing DIFFERS: the initial
        weights, else the gradients of step 1 (the first forward, backward and reduction),
        else the category furthest past its bound (what K steps made of it)."""
        differs = [r for r in self.rows if r.verdict == DIFFERS]
        for first in ("initial weights", "gradients, step 1"):
            found = next((r for r in differs if r.category == first), None)
            if found is not None:
                return found
        return max(differs, key=lambda r: r.rel_diff / r.bound if r.bound else float("inf"),
                   default=None)

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "title": self.title, "reference": self.reference,
                "categories": [dataclasses.asdict(r) for r in self.rows],
                "memory": {k: {"measured": m, "planned": p} for k, (m, p) in self.memory.items()},
                "comm": self.comm, "notes": self.notes}

    def print(self, console: Console | None = None) -> None:
        """The tables and the verdict's line."""
        console = console or Console()
        t = Table(title=f"parity: {self.title}, against {self.reference}",
                  title_justify="left")
        for col in ("category", "tensors", "max abs diff", "max rel diff", "bound", "where",
                    "verdict"):
            t.add_column(col, justify="left" if col in ("category", "where") else "right")
        for r in self.rows:
            t.add_row(r.category, str(r.tensors), f"{r.abs_diff:.2e}", f"{r.rel_diff:.2e}",
                      f"{r.bound:.1e}", r.where if r.abs_diff else "",
                      f"[{_STYLE[r.verdict]}]{r.verdict}[/]")
        console.print(t)
        if self.memory:
            m = Table(title="rank 0, MB", title_justify="left")
            for col in ("category", "the ledger", "the planner"):
                m.add_column(col, justify="right")
            for k, (measured, planned) in self.memory.items():
                m.add_row(k, f"{measured / MB:.3f}",
                          "—" if planned is None else f"{planned / MB:.3f}")
            if self.comm:
                planned = self.comm.get("planned")
                m.add_row("sent per step", f"{self.comm['measured'] / MB:.3f}",
                          "—" if planned is None else f"{planned / MB:.3f}")
            console.print(m)
        for note in self.notes:
            console.print(f"note: {note}")
        console.print(self.summary(), markup=False)

    def summary(self) -> str:
        """The verdict in one line."""
        first = self.first_difference
        if first is not None:
            why = first.note or (f"relative difference {first.rel_diff:.3g} in {first.where}, "
                                 f"above the bound {first.bound:.2g}")
            return f"DIFFERS: {first.category}: {why}"
        if self.verdict == BITWISE:
            return "bitwise: every tensor equals the unsharded model's"
        worst = max(self.rows, key=lambda r: r.rel_diff / r.bound if r.bound else 0.0)
        return (f"within rounding: the largest difference, {worst.rel_diff:.3g} relative in "
                f"{worst.category} ({worst.where}), is within its bound {worst.bound:.2g}")
