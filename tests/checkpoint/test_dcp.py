"""torch.distributed.checkpoint both ways (issue 27), on one spawn of 4 gloo ranks whose
groups of 1, 2 and 4 ranks are the data-parallel groups (``zs.shard(group=...)``).

- Every pair of (N, stage) among N = 1, 2, 4 and stages 0-3, and hybrid sharding (N = 4
  in shard groups of 2): a DCP checkpoint of the model and AdamW written through
  ``get_model_state_dict`` / ``get_optimizer_state_dict`` at one loads at the other
  through ``set_state_dict``, bit for bit (DCP's own resharding).
- The issue's own flow: ``dcp.save(model.state_dict())`` at stage 3, ``dcp.load`` into a
  fresh model's ``state_dict()`` and ``load_state_dict`` — at stage 1 (was a size
  mismatch) and at stage 3 (was silently one rank's rows for every rank).
- FSDP2 (``fully_shard``) trains 5 steps and saves; zeroshard loads at another N and
  stage and trains 5 more; FSDP2 continuing its own ends within 1e-6. And back.

The model has a parameter of 5 rows (2, 2, 1 and 0 of them per rank at N = 4), one of 2
rows, and a 0-d one (a DTensor of shape (1,); FSDP2's model leaves it out:
``fully_shard`` refuses scalar parameters)."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._pytree import tree_map_only

import zeroshard as zs
from zeroshard.runtime.spawn import spawn

from ..engine import engine_cases as cases

pytestmark = [pytest.mark.dist, pytest.mark.slow]

#: (N, stage, shard group K): K = 2 at N = 4 is hybrid sharding's 2-D mesh
PLAIN = [(n, s, None) for n in (1, 2, 4) for s in range(4)]
HYBRID = [(4, 3, 2), (4, 1, 2)]
CONFIGS = PLAIN + HYBRID
#: (written at, loaded at): every plain pair, hybrid to and from plain and itself
PAIRS = ([(a, b) for a in PLAIN for b in PLAIN]
         + [p for h in HYBRID for x in ((1, 0, None), (2, 3, None)) for p in ((h, x), (x, h))]
         + [(HYBRID[0], HYBRID[1]), (HYBRID[1], HYBRID[0])])
FULL = StateDictOptions(full_state_dict=True)


class Net(nn.Module):
    def __init__(self, scalar: bool = True):
        super().__init__()
        self.inp = nn.Linear(6, 5)  # 5 rows: 2, 2, 1, 0 at N = 4
        self.blocks = nn.ModuleList(cases.Block(5) for _ in range(2))
        self.head = nn.Linear(5, 2)
        if scalar:
            self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        out = self.head(h)
        return F.mse_loss(out * self.scale if hasattr(self, "scale") else out, y)


class World:
    """This rank's data-parallel group of each size. Every rank makes every group (and
    takes part in every ``zs.shard``, which makes the model's own groups); the group of
    ranks [0, N) trains, writes and loads, the others wait."""

    def __init__(self, root: str):
        self.root, self.groups, self.refs = root, {}, {}
        for n in (1, 2):
            for start in range(0, dist.get_world_size(), n):
                g = dist.new_group(list(range(start, start + n)))
                if start <= dist.get_rank() < start + n:
                    self.groups[n] = g
        self.groups[4] = None

    def active(self, n: int) -> bool:
        return dist.get_rank() < n

    def steps(self, net, opt, n: int, a: int, b: int) -> None:
        for s in range(a, b):
            net(*cases.batch("mlp", s, rank=dist.get_rank(), world=n)).backward()
            opt.step()
            opt.zero_grad()

    def save(self, net, opt, n: int, name: str) -> None:
        """A DCP checkpoint ``name``, and the full state it holds (``name.ref``) for
        every loader to check against."""
        dcp.save(_state(net, opt), checkpoint_id=f"{self.root}/{name}",
                 process_group=self.groups[n])
        self.keep(_full(net, opt), name)

    def keep(self, value, name: str) -> None:
        if dist.get_rank() == 0:
            torch.save(value, f"{self.root}/{name}.ref")

    def ref(self, name: str):
        if name not in self.refs:
            self.refs[name] = torch.load(f"{self.root}/{name}.ref", weights_only=False)
        return self.refs[name]


def _zs(w: World, n, stage, k, lr=1e-2, scalar=True):
    torch.manual_seed(0)
    net = zs.shard(Net(scalar), stage=stage, group=w.groups[n], shard_group=k)
    return net, torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.1)


def _fsdp(w: World, n, lr=1e-2):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    group = w.groups[n] or dist.distributed_c10d._get_default_group()
    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    net = Net(scalar=False)
    for b in net.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.1)


def _state(net, opt):
    return {"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)}


def _load(w: World, n, net, opt, path):
    state = _state(net, opt)
    dcp.load(state, checkpoint_id=path, process_group=w.groups[n])
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _full(net, opt):
    """Full weights and optimizer state (a collective): the reference a load must meet.
    Copies: torch hands out a plain tensor (Adam's step) as the optimizer's own."""
    full = {"model": get_model_state_dict(net, options=FULL),
            "optim": get_optimizer_state_dict(net, opt, options=FULL)}
    return tree_map_only(torch.Tensor, torch.clone, full)


def _rows(t, full: torch.Tensor) -> bool:
    """Whether ``t`` holds ``full`` (this rank's rows of it, for a DTensor)."""
    if not isinstance(t, DTensor):
        return torch.equal(t, full)
    full = full.reshape(t.shape)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return torch.equal(t.to_local(), full[offset[0]:offset[0] + shape[0]])


def _holds(net, opt, ref) -> bool:
    """What this rank holds of the model and AdamW equals ``ref``, bit for bit (no
    collective: each rank checks its own rows)."""
    weights = net.state_dict()
    ok = weights.keys() == ref["model"].keys()
    ok = ok and all(_rows(v, ref["model"][k]) for k, v in weights.items())
    names = [n for n, _ in net.named_parameters()]
    osd = opt.state_dict()
    for index, state in osd["state"].items():
        want = ref["optim"]["state"][names[index]]
        ok = ok and state.keys() == want.keys()
        ok = ok and all(_rows(v, want[key]) for key, v in state.items())
    group, saved = osd["param_groups"][0], ref["optim"]["param_groups"][0]
    return ok and group["lr"] == saved["lr"] and len(osd["state"]) == len(names)


def _grid(root: str) -> dict:
    w, out = World(root), {}
    for c, (n, stage, k) in enumerate(CONFIGS):  # each trains its own way: distinct states
        net, opt = _zs(w, n, stage, k, lr=1e-2 * (1 + c))
        if w.active(n):
            w.steps(net, opt, n, 0, 1 + c % 3)
            w.save(net, opt, n, f"grid{c}")
    dist.barrier()
    for loader in CONFIGS:
        n, stage, k = loader
        net, opt = _zs(w, n, stage, k, lr=5.0)
        if not w.active(n):
            continue
        weight = net.state_dict()["inp.weight"]
        out[("layout", loader)] = (weight.device_mesh.mesh_dim_names, weight.placements,
                                   tuple(weight.to_local().shape))
        for c, writer in enumerate(CONFIGS):
            if (writer, loader) in PAIRS:
                _load(w, n, net, opt, f"{root}/grid{c}")
                out[("dcp", writer, loader)] = _holds(net, opt, w.ref(f"grid{c}"))
    dist.barrier()
    out.update(_plain_state_dict(w))
    out.update(_fsdp_both_ways(w))
    return out


def _plain_state_dict(w: World) -> dict:
    """The issue's flow, on ``model.state_dict()`` and ``optimizer.state_dict()``."""
    out = {}
    net, opt = _zs(w, 2, 3, None)
    mine = f"{w.root}/rank{dist.get_rank()}.pt"
    if w.active(2):
        w.steps(net, opt, 2, 0, 3)
        dcp.save({"model": net.state_dict(), "optim": opt.state_dict()},
                 checkpoint_id=f"{w.root}/plain", process_group=w.groups[2])
        w.keep(_full(net, opt), "plain")
        torch.save({"model": net.state_dict(), "optim": opt.state_dict()}, mine)
    dist.barrier()
    for stage in (1, 3):
        fresh, fresh_opt = _zs(w, 2, stage, None)
        if not w.active(2):
            continue
        w.steps(fresh, fresh_opt, 2, 5, 6)  # makes AdamW's state, other values
        state = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
        dcp.load(state, checkpoint_id=f"{w.root}/plain", process_group=w.groups[2])
        fresh.load_state_dict(state["model"])
        fresh_opt.load_state_dict(state["optim"])
        out[("plain", stage)] = _holds(fresh, fresh_opt, w.ref("plain"))
    # torch.save of the DTensor state dicts on every rank: a per-rank copy, same N and stage
    fresh, fresh_opt = _zs(w, 2, 3, None)
    if w.active(2):
        w.steps(fresh, fresh_opt, 2, 5, 6)
        state = torch.load(mine, weights_only=False)
        fresh.load_state_dict(state["model"])
        fresh_opt.load_state_dict(state["optim"])
        out[("torch.save", 3)] = _holds(fresh, fresh_opt, w.ref("plain"))
    return out


def _fsdp_both_ways(w: World) -> dict:
    """FSDP2 at N = 2 -> zeroshard at N = 4 and 1; zeroshard at N = 2, stage 3 -> FSDP2 at
    N = 4 and 1: each loads bit for bit, trains 5 more steps, and ends where the writer,
    continuing, ends."""
    out = {}
    for source in ("fsdp", "zeroshard"):
        if source == "fsdp":
            net, opt = _fsdp(w, 2) if w.active(2) else (None, None)
        else:
            net, opt = _zs(w, 2, 3, None, scalar=False)
        if w.active(2):
            w.steps(net, opt, 2, 0, 5)
            w.save(net, opt, 2, source)
            w.steps(net, opt, 2, 5, 10)
            w.keep(_full(net, opt)["model"], f"{source}-ended")
        dist.barrier()
        targets = ([("zeroshard", 4, 3), ("zeroshard", 1, 1), ("zeroshard", 4, 0)]
                   if source == "fsdp" else [("fsdp", 4, None), ("fsdp", 1, None)])
        for kind, n, stage in targets:
            if kind == "zeroshard":
                net, opt = _zs(w, n, stage, None, scalar=False)
            elif w.active(n):
                net, opt = _fsdp(w, n)
            if not w.active(n):
                continue
            _load(w, n, net, opt, f"{w.root}/{source}")
            loaded = _holds(net, opt, w.ref(source))
            w.steps(net, opt, n, 5, 10)
            out[(source, kind, n, stage)] = (loaded, cases.max_rel_diff(
                _full(net, opt)["model"], w.ref(f"{source}-ended")))
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(_grid, 4, str(tmp_path_factory.mktemp("dcp")), timeout=600)


def test_every_n_and_stage_loads_every_other_bit_for_bit(ranks):
    checked = {(key, rank): ok for rank, res in enumerate(ranks)
               for key, ok in res.items() if key[0] == "dcp"}
    # every pair, checked on each of the loader's N ranks (its own rows each)
    assert len(checked) == sum(loader[0] for _, loader in PAIRS)
    assert [k for k, ok in checked.items() if not ok] == []


def test_state_dicts_are_dtensors_laid_out_as_the_shards(ranks):
    """5 rows at N = 4 are 2, 2, 1 and 0 (DTensor's uneven split, rank 3 holds none);
    hybrid sharding is FSDP2's 2-D mesh; stage 0 and N = 1 hold every row."""
    for n, stage, k in CONFIGS:
        layouts = [r[("layout", (n, stage, k))] for r in ranks[:n]]
        names = {x[0] for x in layouts}
        placements = {str(x[1]) for x in layouts}
        rows = [x[2][0] for x in layouts]
        assert names == {("replicate", "shard") if k else ("shard",)}
        if stage == 0 or n == 1:  # whole on every rank (at N = 1 the two are one)
            assert placements == {"(Replicate(), Replicate())" if k else "(Replicate(),)"}
            assert rows == [5] * n
        else:
            assert placements == {"(Replicate(), Shard(dim=0))" if k else "(Shard(dim=0),)"}
            assert rows == {1: [5], 2: [3, 2], 4: [3, 2, 3, 2] if k else [2, 2, 1, 0]}[n]


def test_dcp_of_the_plain_state_dicts_reshards(ranks):
    for r in ranks[:2]:
        assert r[("plain", 1)] and r[("plain", 3)]


def test_torch_save_of_the_state_dicts_on_every_rank_loads_back(ranks):
    for r in ranks[:2]:
        assert r[("torch.save", 3)]


def test_fsdp2_and_zeroshard_load_each_other_and_train_on(ranks):
    assert len([k for k in ranks[0] if k[0] in ("fsdp", "zeroshard")]) == 5
    for r in ranks:
        for key, value in r.items():
            if key[0] in ("fsdp", "zeroshard"):
                loaded, diff = value
                assert loaded, key
                assert diff < 1e-6, (key, diff)
