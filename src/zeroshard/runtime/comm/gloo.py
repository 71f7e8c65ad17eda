"""The reduce-scatter and all-gather the engine runs on CPU tensors over gloo
(``Collectives`` chooses them; each builder issues its collective asynchronously and
returns one waitable).

[Note: gloo] torch's gloo reduce-scatter and all-gather stage their data through extra
full-size copies; the engine's use gloo's in-place collectives and point-to-point sends:

- gloo's reduce-scatter runs an all-reduce on a copy of its input. An all-reduce of the
  input in place, then this rank's slot copied out, sums every element in the same
  order (the same bits) without the copy; ``bench/gloo_collectives.py`` on 2 CPU cores,
  2-4 ranks, a 7 MB buffer: 0.70-0.85x the time, and no copy of the input in flight
  (:func:`all_reduce_slot`).
- Between two ranks it is an exchange instead (:func:`exchange_slots`): each rank sends
  the other the slot it does not keep and receives its own into the output, then adds
  its own part — half the bytes of the all-reduce (which also sends the summed slots
  back), and the same bits, as a + b = b + a in floating point. 43 MB at 2 ranks:
  0.46-0.49x the all-reduce's time and CPU. From three ranks a ring of sends would add
  in another order than the all-reduce torch DDP makes (stages 1-3 would no longer match
  it, nor stage 0, bit for bit), so it stays the all-reduce there.
- gloo's all-gather gathers into a fresh flat buffer the size of the output and copies
  it out when done. N broadcasts in place, rank k's from rank k into slot k of the
  output (:func:`broadcast_slots`), move the same bytes per rank and need no buffer:
  0.66-0.80x the time, and one output-sized buffer less in flight (at stage 3 a
  prefetched unit held twice its size). Up to ``GLOO_BROADCAST_MAX`` ranks only, the
  range measured: each broadcast is a binomial tree of ⌈log2 N⌉ hops, and past a few
  ranks N of them, two at a time on gloo's worker threads, are not known to beat its
  all-gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Then:
    """Work handles waited as one, then ``then()`` once: ``wait()`` may be called again
    (the units of a reduce bucket share one handle) and does nothing more."""

    def __init__(self, *works, then=None):
        self.works, self.then, self.done = works, then, False

    def wait(self) -> None:
        if self.done:
            return
        for w in self.works:
            w.wait()
        if self.then is not None:
            self.then()
        self.done = True


def exchange_slots(out: torch.Tensor, inp: torch.Tensor, group, rank: int, seq: int,
                   divisor: int | None) -> Then:
    """Two ranks' reduce-scatter: ``inp`` [2·S] holds this rank's part of both slots;
    ``out`` [S] receives the sum of slot ``rank`` (divided by ``divisor``, if any).
    ``seq``, the collective's number, alike on both ranks, tags the two messages."""
    peer, dst, slots = 1 - rank, out.view(-1), inp.view(2, -1)
    tag = seq % 2**31
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, slots[peer], group=group, group_peer=peer, tag=tag),
        dist.P2POp(dist.irecv, dst, group=group, group_peer=peer, tag=tag)])

    def then():
        dst.add_(slots[rank])  # the peer's part + this rank's: the sum's bits
        if divisor:
            dst.div_(divisor)
    return Then(*works, then=then)


def all_reduce_slot(out: torch.Tensor, inp: torch.Tensor, group, k: int, rank: int,
                    divisor: int | None) -> Then:
    """K ranks' reduce-scatter: ``inp`` [K·S] is summed in place (every slot holds the
    group's sums afterwards) and slot ``rank`` lands in ``out``, divided as it is copied."""
    work = dist.all_reduce(inp, group=group, async_op=True)
    slot, dst = inp.view(k, -1)[rank], out.view(-1)
    return Then(work, then=(lambda: torch.div(slot, divisor, out=dst)) if divisor
                else (lambda: dst.copy_(slot)))


def broadcast_slots(out: torch.Tensor, inp: torch.Tensor, group, k: int, rank: int) -> Then:
    """K ranks' all-gather: ``out`` [K, ·] receives rank j's ``inp`` in slot j by K
    broadcasts in place (``inp`` may already be this rank's slot of ``out``)."""
    slots = out.view(k, -1)
    if slots[rank].data_ptr() != inp.data_ptr():
        slots[rank].copy_(inp.view(-1))
    return Then(*[dist.broadcast(slots[j], group_src=j, group=group, async_op=True)
                  for j in range(k)])
