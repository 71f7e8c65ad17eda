"""torch's gloo reduce-scatter and all-gather against the engine's (``Collectives``:
an exchange of slots at 2 ranks, else an all-reduce in place; N broadcasts in place),
at 2-4 ranks; and a reduce-scatter
written from point-to-point sends, the one way to move half an all-reduce's bytes on
gloo.

    python bench/gloo_collectives.py                # a 7.1 MB buffer, the medium unit's
    python bench/gloo_collectives.py --mb 28 --ranks 2,4

For each: the median time of 10 calls (issued asynchronously, then waited) and the
most heap bytes in use beyond the caller's buffers while one is in flight (the
staging copies; ``heap.py``'s sampler), and whether the results are bit-equal. The
ring of sends (N-1 rounds: send the partial sum of one slot to the next rank, receive
another from the previous one, add it; each rank sends (N-1)/N of the buffer, half
what an all-reduce sends) is timed against the engine's reduce-scatter, with the CPU
seconds of the rank's process (every thread: gloo's copies included), which is what
ranks sharing cores pay.
"""

from __future__ import annotations

import argparse
import statistics
import time

from heap import HeapPeak


def _rank(numel: int) -> dict:
    import torch
    import torch.distributed as dist

    from zeroshard.runtime.collectives import Collectives
    from zeroshard.runtime.ledger import Ledger
    from zeroshard.runtime.mesh import Mesh

    n, r = dist.get_world_size(), dist.get_rank()
    comm = Collectives(Ledger(), Mesh.build(None))
    torch.manual_seed(r)
    slot = numel // n
    src = torch.randn(n * slot)  # 1D [N·S]: a reduce-scatter's input, an all-gather's output
    shard = torch.randn(slot)

    def measure(fn):
        """fn(buffers) -> work; buffers are made before the sampler starts."""
        times, peak = [], 0
        for _ in range(10):
            bufs = (src.clone(), torch.empty(slot), torch.empty(n, slot))
            dist.barrier()
            heap = HeapPeak(1e-4).start()
            t0 = time.perf_counter()
            fn(*bufs).wait()
            times.append(time.perf_counter() - t0)
            heap.stop()
            peak = max(peak, heap.growth or 0)
        return statistics.median(times), peak, bufs

    rs_torch = measure(lambda inp, out, _: dist.reduce_scatter_tensor(out, inp, async_op=True))
    rs_ours = measure(lambda inp, out, _: comm.reduce_scatter(out, inp, async_op=True))
    ag_torch = measure(lambda _, __, out: dist.all_gather_into_tensor(out.view(-1), shard,
                                                                      async_op=True))
    ag_ours = measure(lambda _, __, out: comm.all_gather(out, shard, async_op=True))
    nxt, prev = (r + 1) % n, (r - 1) % n

    def ring(inp):
        """Rank r ends with the sum of slot r; ``inp`` [N·S] holds the partial sums."""
        slots, got = inp.view(n, slot), torch.empty(slot)
        for k in range(n - 1):  # round k: send slot r-k-1, receive slot r-k-2 and add it
            ops = [dist.P2POp(dist.isend, slots[(r - k - 1) % n], nxt),
                   dist.P2POp(dist.irecv, got, prev)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            slots[(r - k - 2) % n].add_(got)
        return slots[r]

    def cpu(fn):
        """Median wall and process CPU seconds of ``fn(src.clone())`` over 10 calls."""
        walls, cpus = [], []
        for _ in range(10):
            inp = src.clone()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn(inp)
            cpus.append(time.process_time() - c0)
            walls.append(time.perf_counter() - t0)
        return statistics.median(walls), statistics.median(cpus)

    sends = cpu(ring)
    engine = cpu(lambda inp: comm.reduce_scatter(torch.empty(slot), inp, async_op=True).wait())
    summed = src.clone()
    dist.all_reduce(summed)
    close = torch.allclose(ring(src.clone()), summed.view(n, slot)[r], rtol=1e-6, atol=1e-6)
    return {
        "ring": (sends, engine, close),
        "reduce_scatter": (rs_torch[:2], rs_ours[:2], torch.equal(rs_torch[2][1], rs_ours[2][1])),
        "all_gather": (ag_torch[:2], ag_ours[:2], torch.equal(ag_torch[2][2], ag_ours[2][2])),
    }


def main() -> None:
    from zeroshard.runtime.spawn import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=7.1, help="buffer size in MB (fp32)")
    p.add_argument("--ranks", default="2,3,4", help="comma-separated world sizes")
    a = p.parse_args()
    numel = int(a.mb * 1e6 / 4)
    print(f"{'ranks':>5}  {'collective':<14} {'torch ms':>9} {'ours ms':>8} {'ratio':>6}"
          f"  {'torch staging MB':>16} {'ours MB':>8}  bit-equal")
    for n in (int(k) for k in a.ranks.split(",")):
        res = spawn(_rank, n, numel, timeout=600)
        for kind in ("reduce_scatter", "all_gather"):
            (t_torch, m_torch), (t_ours, m_ours), equal = res[0][kind]
            same = all(rr[kind][2] for rr in res)
            print(f"{n:>5}  {kind:<14} {t_torch * 1e3:9.2f} {t_ours * 1e3:8.2f} "
                  f"{t_ours / t_torch:5.2f}x  {m_torch / 1e6:16.2f} {m_ours / 1e6:8.2f}  {same}")
        (w_ring, c_ring), (w_eng, c_eng), _ = res[0]["ring"]
        close = all(rr["ring"][2] for rr in res)
        print(f"{n:>5}  reduce_scatter as a ring of sends: {w_ring * 1e3:.2f} ms against the "
              f"engine's {w_eng * 1e3:.2f} ({w_ring / w_eng:.2f}x); CPU {c_ring * 1e3:.2f} ms "
              f"against {c_eng * 1e3:.2f} ({c_ring / c_eng:.2f}x); the sum within 1e-6: {close}")


if __name__ == "__main__":
    main()
