"""The constants and formulas the planner and the engine both count with.

Ring accounting (ZeRO paper, section 7; the third source document): over N ranks an
all-reduce of T bytes sends 2(N-1)/N·T bytes per rank, a reduce-scatter (T = its input)
or an all-gather (T = its output) (N-1)/N·T. The engine's ledger records what the
algorithm sends, whatever the backend moves underneath, so measured and planned bytes
are one quantity.
"""

from __future__ import annotations

#: Elements per quantization block of ZeRO++'s qwZ and qgZ (one fp32 scale each).
QUANT_BLOCK = 2048
#: Elements of a rank's optimizer partition that disk offload steps at once (DeepSpeed's
#: ``sub_group_size``; its default is 1e9).
SUB_GROUP_SIZE = 100_000_000
#: torch DDP's gradient bucket (``bucket_cap_mb=25``): stage 0's default reduce bucket
DDP_BUCKET_BYTES = 25 * 2**20
#: On gloo the engine all-gathers by K in-place broadcasts up to this many ranks, the
#: range measured faster than gloo's own all-gather (``runtime/collectives.py``).
GLOO_BROADCAST_MAX = 4


def ceil_div(a: int, b: int) -> int:
    """⌈a / b⌉ for integers, exact at any size (no float)."""
    return -(-a // b)


def ring_all_reduce(t: int, n: int) -> int:
    """Bytes one rank sends in a ring all-reduce of t bytes: 2(N-1)/N·t."""
    return ceil_div(2 * (n - 1) * t, n)


def ring_one_way(t: int, n: int) -> int:
    """Bytes one rank sends in a ring reduce-scatter or all-gather of t bytes: (N-1)/N·t."""
    return ceil_div((n - 1) * t, n)


def quantized_nbytes(numel: int, block: int = QUANT_BLOCK) -> int:
    """Bytes on the wire for ``numel`` elements quantized in blocks of ``block``: one int8
    each plus one fp32 scale per block, ``numel + 4⌈numel/block⌉``."""
    return numel + 4 * ceil_div(numel, block)


def dim0_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[a, b)`` of a parameter of ``rows`` rows that ``rank`` of ``world`` holds:
    chunks of c = ceil(rows / world), the last ranks' short or empty (FSDP2's dim-0
    layout). The one place this arithmetic lives: the engine's layout, clipping,
    checkpoints and the planner use it."""
    return chunk_span(rows, rank, ceil_div(rows, world))


def chunk_span(rows: int, rank: int, c: int) -> tuple[int, int]:
    """Rows ``[a, b)`` of ``rows`` in ``rank``'s chunk of ``c`` rows (:func:`dim0_rows`)."""
    a = min(rows, rank * c)
    return a, min(rows, a + c)
