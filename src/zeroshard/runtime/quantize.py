"""Block-quantized collectives (ZeRO++'s qwZ and qgZ): int8 in blocks, one fp32 scale each.

[Note: the format] A slot of n elements (a rank's shard, or one rank's slot of a
reduce-scatter input) is cut into ⌈n/B⌉ blocks of B = ``block`` elements, the last one
shorter; blocks never straddle slots. Per block b, symmetric absmax quantization:

    s_b = max_i |x_i| / 127          (fp32; s_b = 0 for an all-zero block)
    q_i = round(x_i / s_b)           (round half to even, torch.round: deterministic)
    x̂_i = q_i · s_b                  (computed in fp32, then cast to the target dtype)

so |x_i - x̂_i| <= s_b / 2 = max|x| / 254 per element, up to fp32 rounding (relative
2^-24), and x̂ = x exactly when every x_i is an integer multiple (|k| <= 127) of a power
of two s_b. Blocks whose max|x| is below 127 · 2^-149 (scale underflows) send zeros.
A block holding an inf or NaN gets a non-finite scale and its q are set to 0, so every
element of it dequantizes to 0 · s_b = NaN: non-finite stays non-finite (as NaN, sign
lost), and the engine's non-finite check still sees it.

On the wire each slot is one int8 row ``[scales as 4⌈n/B⌉ bytes | q as n bytes]``: one
collective per call, n + 4⌈n/B⌉ bytes per slot (1 + 4/B bytes per element, no padding).

[Note: quantized on gloo] torch 2.13's gloo runs ``all_to_all_single`` (even splits) and
``all_gather_single`` on int8 CPU tensors, as NCCL does on CUDA, so qgZ is a real
all-to-all on both; checked by ``tests/engine/test_quantize.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..spec.formulas import QUANT_BLOCK, ceil_div, quantized_nbytes
from .ledger import ring_bytes

# QUANT_BLOCK (spec/formulas.py): DeepSpeed's qwZ picks groups of about 4-8k elements
# (``CUDAQuantizer.target_group_size = 8000``, "optimal 4k", hard limit 16k); 2048, a
# power of two below that, halves the elements sharing a scale for 0.2% more bytes
# (4/2048 per element): 1.00195 bytes per element instead of bf16's 2.
QMAX = 127  # symmetric int8: q in [-127, 127], -128 unused so that -q is always valid

# torch 2.13 renamed all_gather_into_tensor; the old name warns. Older releases: old name.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _n_blocks(numel: int, block: int) -> int:
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r}: the quantization block must be an int >= 1")
    return ceil_div(numel, block)


def quantized_ring_bytes(kind: str, slot_numel: int, world: int,
                         block: int = QUANT_BLOCK) -> int:
    """Bytes one rank sends for a quantized ``"all_gather"`` (``slot_numel`` = the
    shard) or ``"reduce_scatter"`` (``slot_numel`` = the output slot) over ``world``
    ranks, in the ledger's ring accounting: (N-1)/N of the N slots' wire bytes, which
    is also exactly what the all-to-all sends (N-1 slots to the others)."""
    if kind not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"kind={kind!r}: quantized collectives are 'all_gather' and "
                         "'reduce_scatter'")
    return ring_bytes(kind, world * quantized_nbytes(slot_numel, block), world)


def _quantize_rows(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [R, n] -> (q int8 [R, n], scales fp32 [R, ⌈n/block⌉]), blocks per row."""
    rows, n = x.shape
    nb = _n_blocks(n, block)
    xf = torch.zeros(rows, nb * block, dtype=torch.float32, device=x.device)
    xf[:, :n] = x  # cast to fp32 and zero-pad the last block in one copy
    xb = xf.view(rows, nb, block)
    scales = xb.abs().amax(dim=2) / QMAX  # amax propagates NaN; inf stays inf
    finite = torch.isfinite(scales)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))  # zero block: q = 0
    q = xb.div_(divisor.unsqueeze(-1)).round_().clamp_(-QMAX, QMAX)
    q.masked_fill_(~finite.unsqueeze(-1), 0)  # NaN has no int8 value; q · s_b is NaN anyway
    return q.to(torch.int8).view(rows, nb * block)[:, :n].contiguous(), scales


def _dequantize_rows(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """(q int8 [R, n], scales fp32 [R, nb]) -> fp32 [R, n]: q · s per block."""
    rows, n = q.shape
    nb = scales.shape[1]
    assert nb == _n_blocks(n, block), (nb, n, block)
    qf = torch.zeros(rows, nb * block, dtype=torch.float32, device=q.device)
    qf[:, :n] = q
    return qf.view(rows, nb, block).mul_(scales.unsqueeze(-1)).view(rows, -1)[:, :n]


def quantize(x: torch.Tensor, block: int = QUANT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any shape, any float dtype) -> (q: int8, flat, ``x.numel()`` elements;
    scales: fp32, ``⌈numel/block⌉``). See [Note: the format]."""
    q, scales = _quantize_rows(x.reshape(1, -1), block)
    return q.view(-1), scales.view(-1)


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: int = QUANT_BLOCK,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Flat ``q · s`` per block, computed in fp32 and returned in ``dtype`` (``q.numel()``
    elements: :func:`quantize` sends no padding, so the count is q's)."""
    return _dequantize_rows(q.view(1, -1), scales.view(1, -1), block).view(-1).to(dtype)


def _pack(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows ``[scales' bytes | q]`` as int8 [R, 4·nb + n]: one buffer, one collective."""
    nb4 = scales.shape[1] * 4
    buf = torch.empty(q.shape[0], nb4 + q.shape[1], dtype=torch.int8, device=q.device)
    buf[:, :nb4] = scales.contiguous().view(torch.int8)
    buf[:, nb4:] = q
    return buf


def _unpack(buf: torch.Tensor, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The scales are copied out (4·nb bytes a row): a row's offset need not be 4-aligned.
    return buf[:, 4 * nb:], buf[:, :4 * nb].contiguous().view(torch.float32)


class QuantizedWork:
    """A quantized collective in flight: ``wait()`` waits for the transfer, then
    dequantizes into the output (once; later calls return at once). Holds the send and
    receive buffers until then."""

    def __init__(self, work, finish: Callable[[], None], *buffers: torch.Tensor):
        self.work, self.finish, self.buffers, self.done = work, finish, buffers, False

    def wait(self) -> None:
        if self.done:
            return
        self.work.wait()
        self.finish()
        self.done, self.buffers = True, ()


def _start(work, finish: Callable[[], None], async_op: bool, *buffers: torch.Tensor):
    handle = QuantizedWork(work, finish, *buffers)
    if async_op:
        return handle
    handle.wait()
    return None


def quantized_all_gather(out: torch.Tensor, inp: torch.Tensor, group=None,
                         block: int = QUANT_BLOCK, *, async_op: bool = False):
    """qwZ: ``out`` (K × ``inp``, any float dtype) receives every rank's ``inp`` in rank
    order, each quantized by its owner, sent as int8 + scales (one all-gather of
    K · :func:`quantized_nbytes` bytes), and dequantized here into ``out.dtype`` —
    slot k equals ``dequantize(*quantize(inp_k))`` bit for bit. Returns None once done,
    or with ``async_op`` a :class:`QuantizedWork` to ``wait()`` on; ``out`` is written
    in the wait."""
    k, s = dist.get_world_size(group), inp.numel()
    if out.numel() != k * s:
        raise ValueError(f"out has {out.numel()} elements; {k} ranks x {s} needed")
    q, scales = _quantize_rows(inp.reshape(1, -1), block)
    send = _pack(q, scales)
    recv = torch.empty(k, send.shape[1], dtype=torch.int8, device=inp.device)
    work = _all_gather(recv.view(-1), send.view(-1), group=group, async_op=True)

    def finish() -> None:
        qs, sc = _unpack(recv, scales.shape[1])
        out.view(k, s).copy_(_dequantize_rows(qs, sc, block))
    return _start(work, finish, async_op, send, recv)


def quantized_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group=None,
                             block: int = QUANT_BLOCK, mean_divisor: float | None = None,
                             *, async_op: bool = False):
    """qgZ: ``out`` (1/K of ``inp``) receives the sum over the K ranks of their slot
    ``rank`` of ``inp``. Each rank quantizes its K slots, one all-to-all hands every
    rank each one's quantized copy of its slot (K · :func:`quantized_nbytes` bytes in,
    the same out), which is dequantized and summed in fp32 in rank order (one
    quantization per input, none of partial sums: the error does not grow hop by hop
    as a quantized ring's would), divided by ``mean_divisor`` if given, and cast into
    ``out.dtype``. ``inp`` is left as it was. Returns as :func:`quantized_all_gather`."""
    k, s = dist.get_world_size(group), out.numel()
    if inp.numel() != k * s:
        raise ValueError(f"inp has {inp.numel()} elements; {k} ranks x {s} needed")
    q, scales = _quantize_rows(inp.reshape(k, s), block)
    send = _pack(q, scales)
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv.view(-1), send.view(-1), group=group, async_op=True)

    def finish() -> None:
        qs, sc = _unpack(recv, scales.shape[1])
        slots = _dequantize_rows(qs, sc, block)  # [K, s] fp32: rank j's copy of my slot
        acc = slots[0].clone()
        for j in range(1, k):  # a fixed order: the same bits on every run
            acc.add_(slots[j])
        if mean_divisor is not None:
            acc.div_(mean_divisor)
        out.view(-1).copy_(acc)
    return _start(work, finish, async_op, send, recv)
