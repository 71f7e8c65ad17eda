"""The engine's step for an optimizer whose update needs each whole matrix
(``Need.WHOLE_MATRIX`` in ``spec/optimizers.py``): torch's Muon, by owner computes.

Muon (Jordan et al., 2024; torch's ``_single_tensor_muon``), per matrix W with gradient
G, momentum μ, step by step::

    B <- lerp(B, G, 1 - μ)                         # momentum buffer: elementwise
    M <- lerp(G, B, μ) if nesterov else B          # elementwise
    O <- NewtonSchulz(M)                           # the whole matrix
    W <- W·(1 - lr·wd) - lr·adjust(shape)·O         # elementwise, O's rows

Only O needs the whole matrix. So every rank updates the momentum of its own rows (the
state stays row-sharded, under torch's key ``momentum_buffer``: checkpoints reshard it
like Adam's), and the orthogonalisation is computed once per matrix by its **owner**:

1. owners: ``spec.optimizers.assign_owners`` spreads the matrices over the shard group,
   the costliest Newton-Schulz first to the least loaded rank (the same answer on every
   rank, and in the planner);
2. ``owner_gather``: one all-to-all sends each owner every rank's rows of M for the
   matrices it owns (this rank's own rows stay put);
3. the owner runs torch's ``_zeropower_via_newtonschulz`` on the whole matrix: the very
   function, on the very matrix, of the unsharded step, so O is the same bits;
4. ``owner_scatter``: a second all-to-all sends each rank its rows of O (bf16, the
   dtype torch's iteration returns), and every rank applies weight decay and O to its
   rows with torch's learning-rate adjustment for the *full* shape.

Two all-to-alls a step, whatever the number of matrices; the bytes each rank sends are
its rows of the matrices others own, and, for those it owns, the other ranks' rows of O
(``spec.optimizers.owner_bytes``, which the planner uses and the ledger measures). The
owner holds the whole input and result of the matrices it owns for the step (transient).
Where the optimizer state is offloaded, the iteration runs on the host, where the rows
are; the all-to-alls run on the device the collectives use.
"""

from __future__ import annotations

import torch

from ...spec.optimizers import assign_owners
from ..unit.layout import dim0_chunk
from .rows import drop_grads, rows_of, with_grads

try:  # torch >= 2.9; private, but it is the maths torch's Muon runs
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
except ImportError:  # pragma: no cover - older torch has no Muon class to drive
    _adjust_lr = _zeropower_via_newtonschulz = None


def _scalar(value) -> float:
    return value.item() if torch.is_tensor(value) else float(value)


class MatrixStep:
    """One Muon's step on this rank's rows, each matrix orthogonalised by its owner."""

    def __init__(self, optimizer, stepper):
        if _zeropower_via_newtonschulz is None:  # pragma: no cover
            raise NotImplementedError("torch.optim.Muon on shards needs torch's "
                                      "torch.optim._muon (torch >= 2.9)")
        self.optimizer, self.stepper = optimizer, stepper
        self.comm = stepper.comm
        self.device = stepper.units[0].device  # where the collectives run
        self._owners: dict[tuple, list[int]] = {}

    def owners(self, rows) -> list[int]:
        """The owner of each matrix with a gradient (cached by the matrices present)."""
        key = tuple((r.shape, r.group["ns_steps"]) for r in rows)
        if key not in self._owners:
            world = self.comm.mesh.shard_world
            by_steps: dict[int, list[int]] = {}
            for j, r in enumerate(rows):
                by_steps.setdefault(r.group["ns_steps"], []).append(j)
            owner = [0] * len(rows)
            for steps, js in by_steps.items():  # one balance per iteration count
                for j, o in zip(js, assign_owners([rows[j].shape for j in js], world, steps)):
                    owner[j] = o
            self._owners[key] = owner
        return self._owners[key]

    @torch.no_grad()
    def step(self) -> None:
        every = rows_of(self.optimizer, self.stepper.units)
        rows = with_grads(every)
        if rows:
            momenta = [self._momentum(r) for r in rows]
            ortho = self._orthogonalise(rows, momenta, self.owners(rows))
            for r, o in zip(rows, ortho):
                g = r.group
                lr = _scalar(g["lr"])
                r.shard.mul_(1 - lr * g["weight_decay"])
                r.shard.add_(o, alpha=-_adjust_lr(lr, g["adjust_lr_fn"], torch.Size(r.shape)))
        drop_grads(every)

    def _momentum(self, r) -> torch.Tensor:
        """This rank's rows of M, the momentum buffer updated as torch's Muon does."""
        g, p = r.group, r.shard
        state = self.optimizer.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad,
                                                        memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - g["momentum"])
        return p.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf

    def _orthogonalise(self, rows, momenta, owners) -> list[torch.Tensor]:
        """Each matrix's rows of NewtonSchulz(M), computed by its owner."""
        world, me = self.comm.mesh.shard_world, self.comm.mesh.shard_rank
        cols = [r.shape[1] for r in rows]
        # chunk[k][j]: rows [a, b) of matrix j that rank k holds (the shards' dim-0 chunks)
        chunk = [[dim0_chunk(r.shape[0], k, world) for r in rows] for k in range(world)]
        held = [[b - a for a, b in ranks] for ranks in chunk]
        by_owner = [[j for j, o in enumerate(owners) if o == k] for k in range(world)]
        mine = by_owner[me]
        total = sum(r.numel for r in rows)  # every rank's pieces, for the fingerprint
        # 2. owner_gather: to each owner, this rank's rows of the matrices it owns
        dtype = momenta[0].dtype
        send = torch.cat([momenta[j].reshape(-1) for k in range(world) for j in by_owner[k]]
                         ).to(self.device, dtype)
        in_splits = [sum(held[me][j] * cols[j] for j in by_owner[k]) for k in range(world)]
        out_splits = [sum(held[k][j] * cols[j] for j in mine) for k in range(world)]
        got = torch.empty(sum(out_splits), dtype=dtype, device=self.device)
        self.comm.all_to_all(got, send, out_splits, in_splits, "owner_gather", total)
        # 3. the owner's whole matrices (pieces arrive in rank order, row chunk by chunk)
        got = got.to(rows[0].shard.device)
        pieces, at = {j: [] for j in mine}, 0
        for k in range(world):
            for j in mine:
                n = held[k][j] * cols[j]
                pieces[j].append(got[at:at + n])
                at += n
        results = {}
        for j in mine:
            g = rows[j].group
            whole = torch.cat(pieces[j]).view(rows[j].shape)
            results[j] = _zeropower_via_newtonschulz(whole, g["ns_coefficients"],
                                                     g["ns_steps"], g["eps"])
            assert results[j].dtype == torch.bfloat16  # what every receiver expects
        # 4. owner_scatter: to each rank, its rows of the results this rank owns
        send = torch.cat([results[j][chunk[k][j][0]:chunk[k][j][1]].reshape(-1)
                          for k in range(world) for j in mine]
                         or [torch.empty(0, dtype=torch.bfloat16)]).to(self.device)
        back_in = [sum(held[k][j] * cols[j] for j in mine) for k in range(world)]
        back_out = [sum(held[me][j] * cols[j] for j in by_owner[k]) for k in range(world)]
        back = torch.empty(sum(back_out), dtype=torch.bfloat16, device=self.device)
        self.comm.all_to_all(back, send, back_out, back_in, "owner_scatter", total)
        back = back.to(rows[0].shard.device)
        out, at = [None] * len(rows), 0
        for k in range(world):
            for j in by_owner[k]:
                n = held[me][j] * cols[j]
                out[j] = back[at:at + n].view(held[me][j], cols[j])
                at += n
        return out
