"""The lifecycle of a unit's full parameters, and what memory each state holds."""

from __future__ import annotations

import enum


class UnitState(enum.Enum):
    """What a unit's full parameters hold."""

    SHARDED = "sharded"
    """Stage 3 between uses: full parameters have zero-size storage; only the slot of
    compute weights (1/N of the unit, padded) is held."""
    GATHERING = "gathering"
    """Stage 3: an all-gather is in flight (a prefetch); the full parameters are still
    empty, the gathered [N, S] buffer is allocated."""
    GATHERED = "gathered"
    """Full parameters allocated and filled: always below stage 3; at stage 3 from
    the unit's gather before forward (or backward) to its release after it."""
