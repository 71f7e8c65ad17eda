"""The engine at scale, simulated: N = 8, 64 and 1,024 ranks in this one process.

Each case joins torch's fake process group (``torch.testing._internal.distributed.
fake_pg``, backend ``"fake"``) as one rank r of N, shards a small model, runs two
AdamW steps and reads what the engine reports: its shards' shapes, ``memory()`` in the
second step (after the reductions, before the update, with the optimizer state made by
the first) and ``comm_stats()`` of that step. The numbers are checked against the
planner and against ceil-division written here, never against the engine itself.

What the fake group does with data (torch 2.13): nothing moves between ranks, so every
rank sees a world of copies of itself. ``all_gather`` writes this rank's input into
every slot, ``reduce_scatter`` hands back this rank's own slot of its input,
``all_reduce`` and ``broadcast`` leave tensors as they are, ``all_gather_object``
returns N copies of this rank's object. Values are therefore meaningless (the last
rank at stage 3 gathers only padding), but shapes, allocations and the ledger's bytes
are exactly what rank r of N would have. The numerical proofs stay in the gloo tier.

Two models: ``Uneven`` (``nn.Linear`` layers of 12, 40 and 5 rows: uneven shards at
N = 8, zero-row shards on the last ranks at 64 and 1,024) and ``Wide`` (every
parameter has 1,024 rows, so every shard is even and the planner's per-rank figures
hold exactly at every N).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

import zeroshard as zs
from zeroshard.plan import (
    RECIPES,
    ParallelDims,
    ZeroConfig,
    comm_bytes,
    model_state_bytes,
    ring_all_reduce,
    ring_one_way,
)

WORLDS = (8, 64, 1024)
STAGES = (0, 1, 2, 3)
PRECISIONS = (None, "bf16")
# The planner's recipes for the engine's two precisions. Under mixed precision the
# engine sums gradients in fp32 (ZeroConfig.reduce_dtype's default).
RECIPE = {None: RECIPES["fp32-adamw"],
          "bf16": RECIPES["bf16-mixed-adamw"].with_reduce_dtype("fp32")}


def planned_at(world: int, stage: int, precision) -> tuple[ParallelDims, ZeroConfig]:
    """What the planner is asked: the engine's own configuration on ``world`` ranks."""
    return ParallelDims(world), ZeroConfig(stage=stage, mixed_precision=precision)


# -- models -----------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width: int = 12, hidden: int = 40):
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Uneven(nn.Module):
    """Rows 12 (inp, down), 40 (up) and 5 (head): 3,197 parameters."""

    inputs = 7

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(self.inputs, 12)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(12, 5)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class WideBlock(nn.Module):
    def __init__(self, width: int = 4, rows: int = 1024):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(rows, width) * 0.1)
        self.b = nn.Parameter(torch.zeros(rows))
        self.w_out = nn.Parameter(torch.randn(rows, width) * 0.1)

    def forward(self, x):
        return x + torch.relu(x @ self.w_in.T + self.b) @ self.w_out


class Wide(nn.Module):
    """Every parameter has 1,024 rows: 22,528 parameters, even shards at every N here."""

    inputs = 4

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(WideBlock() for _ in range(2))
        self.head = nn.Parameter(torch.randn(1024, self.inputs) * 0.1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x @ self.head.T


MODELS = {"uneven": Uneven, "wide": Wide}


def ranks_of(model: str, world: int) -> tuple[int, ...]:
    """Every rank of the uneven model at N = 8 (the sums over ranks), else the first
    two, rank 11 (the last with a row of the 12-row parameters at N >= 12) and the last."""
    if model == "uneven" and world == 8:
        return tuple(range(8))
    return (0, 7) if world == 8 else (0, 1, 11, world - 1)


# -- the arithmetic the engine is held against ------------------------------------------
def rows_of(shape) -> int:
    return shape[0] if shape else 1


def row_numel(shape) -> int:
    return math.prod(shape[1:])


def chunk(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [a, b) of a dim-0 chunk: c = ceil(rows / N) rows per rank, the last short or empty."""
    c = -(-rows // world)
    a = min(rows, rank * c)
    return a, min(rows, a + c)


def owned(rows: int, rank: int, world: int) -> int:
    """Real rows of rank's chunk."""
    a, b = chunk(rows, rank, world)
    return b - a


@functools.cache
def shapes_of(model: str) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in MODELS[model]().named_parameters()}


def units_of(model: str) -> list[list[tuple[int, ...]]]:
    """Parameter shapes per unit under the default "blocks" policy: one unit per
    repeated block, and a root unit for the rest."""
    shapes = shapes_of(model)
    root = [s for n, s in shapes.items() if not n.startswith("blocks.")]
    blocks = sorted({n.split(".")[1] for n in shapes if n.startswith("blocks.")}, key=int)
    return [root] + [[s for n, s in shapes.items() if n.startswith(f"blocks.{b}.")]
                     for b in blocks]


def slot_numel(shapes, world: int) -> int:
    """S: elements of one rank's slot, padding included (c rows of every parameter)."""
    return sum(-(-rows_of(s) // world) * row_numel(s) for s in shapes)


def real_numel(shapes, rank: int, world: int) -> int:
    """Elements of rank's slot that are real rows."""
    return sum(owned(rows_of(s), rank, world) * row_numel(s) for s in shapes)


def expected_memory(model: str, world: int, rank: int, stage: int, recipe) -> dict[str, int]:
    """Bytes per category on rank r of N, as the engine defines them (runtime/ledger.py):
    stage k shards the first k of (optimizer, grads, params); each sharded category holds
    the rank's real rows; padding counts the zeros of the padded layouts apart: the full
    weights' [N, c·row] storages at stages 1-2, the full gradients' at stage 0 (they land
    in that layout from the all-reduce), and this rank's slot of weights (stage 3),
    reduced gradients (stages 2-3) and fp32 master (mixed precision, stages 1-3)."""
    shapes = list(shapes_of(model).values())
    P = sum(math.prod(s) for s in shapes)
    S, real = slot_numel(shapes, world), real_numel(shapes, rank, world)
    wb, gb, ob, mb = (recipe.weight_bytes, recipe.grad_bytes, recipe.optimizer_bytes,
                      recipe.master_bytes)
    padding = 0
    if stage == 0:  # full gradients in padded [N, c·row] storages
        padding += gb * (world * S - P)
    if stage in (1, 2):  # full weights in padded [N, c·row] storages
        padding += wb * (world * S - P)
    if stage == 3:
        padding += wb * (S - real)
    if stage >= 2:
        padding += gb * (S - real)
    if stage >= 1:
        padding += mb * (S - real)
    return {
        "params": wb * (real if stage >= 3 else P),
        "grads": gb * (real if stage >= 2 else P),
        "optimizer": ob * (real if stage >= 1 else P),
        "padding": padding,
        "gathered": 0,
    }


def expected_comm(model: str, world: int, stage: int, recipe) -> dict[str, dict[str, int]]:
    """One step's collectives in ring accounting: per unit, one reduction of its N padded
    gradient slots plus one presence flag per parameter in each slot, and (stages 1-2)
    one all-gather of the updated weights or (stage 3) two of the weights, forward and
    backward; each collective after its fingerprint."""
    units = units_of(model)
    rb, wb, n = recipe.reduce_bytes, recipe.weight_bytes, world
    reduce = [rb * n * (slot_numel(u, n) + len(u)) for u in units]
    gather = [wb * n * slot_numel(u, n) for u in units]
    if stage == 0:  # one buffer per bucket (the default, DDP's 25 MiB, where it sums
        # in the gradients' own dtype), units in backward's order
        size = ZeroConfig(stage=0, mixed_precision=recipe).reduce_bucket
        buffers = _buckets(list(reversed(units)), list(reversed(reduce)), size)
        out = {"all_reduce": {"calls": len(buffers),
                              "bytes": sum(ring_all_reduce(t, n) for t in buffers)}}
    else:
        gathers = 2 if stage == 3 else 1
        out = {"reduce_scatter": {"calls": len(units),
                                  "bytes": sum(ring_one_way(t, n) for t in reduce)},
               "all_gather": {"calls": gathers * len(units),
                              "bytes": gathers * sum(ring_one_way(t, n) for t in gather)}}
    # a fingerprint of 7 int64 before each collective, and one agreement that the
    # (unclipped) step's gradients are finite, each gathered from every rank; at stage 0
    # every rank holds the same averaged gradients and reaches the verdict alone
    calls = sum(v["calls"] for v in out.values()) + (stage > 0)
    out["check"] = {"calls": calls, "bytes": calls * ring_one_way(56 * n, n)}
    return out


def _buckets(units, nbytes: list[int], size: int) -> list[int]:
    """Bytes of each reduction buffer: consecutive units share one until their
    parameters reach ``size`` elements (0: one per unit)."""
    out, elements, pending = [], 0, 0
    for shapes, b in zip(units, nbytes):
        elements += sum(math.prod(s) for s in shapes)
        pending += b
        if elements >= size:
            out.append(pending)
            elements = pending = 0
    return out + ([pending] if pending else [])


def planned_kinds(comm: dict) -> int:
    """Bytes of the collectives the planner counts (all but the engine's checks)."""
    return sum(v["bytes"] for kind, v in comm.items() if kind != "check")


# -- the fake world ---------------------------------------------------------------------
@contextlib.contextmanager
def fake_world(world: int, rank: int):
    """This process as rank ``rank`` of ``world`` in the fake process group, destroyed
    (with every group the engine made) on the way out."""
    assert not dist.is_initialized(), "a process group is already initialised"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        gc.collect()  # a sharded model is a reference cycle that holds its groups
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def no_group_left_behind():
    """Every case leaves the process as it found it: no default group, for the tests
    that follow in this pytest process."""
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized()


@pytest.fixture(autouse=True, scope="module")
def quick_cases():
    """Hundreds of tiny cases: one intra-op thread (the tensors are a few KB), and the
    objects alive before them frozen out of the cycle collector, so that collecting each
    case's model costs microseconds rather than a scan of all of torch's objects."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    run("uneven", 8, 0, 0, None)  # a first case imports the rest of the engine and of torch
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
    torch.set_num_threads(threads)


@functools.cache
def run(model: str, world: int, rank: int, stage: int, precision) -> dict:
    with fake_world(world, rank):
        return _two_steps(model, stage, precision)


def _two_steps(model: str, stage: int, precision) -> dict:
    torch.manual_seed(0)
    net = zs.shard(MODELS[model](), stage=stage, mixed_precision=precision)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = torch.randn(4, MODELS[model].inputs)
    seen: list = []

    def step():
        net(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # makes AdamW's state
    net.comm_stats(reset=True)
    # read once the engine's step pre-hook has landed every gradient
    hook = opt.register_step_pre_hook(lambda o, a, k: seen.append((
        net.memory(o),
        # bytes of the storages behind the model's full gradients (stage 0 keeps them)
        sum({g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
             for p in net.module.parameters() if (g := p.grad) is not None}.values()))))
    step()
    hook.remove()
    memory, grad_storage = seen[0]
    return {"shapes": {n: tuple(p.shape) for n, p in net.named_parameters()},
            "memory": memory, "grad_storage": grad_storage, "comm": net.comm_stats()}


def cases(models=("uneven", "wide")):
    return [(m, n, s, p) for m in models for n in WORLDS for s in STAGES for p in PRECISIONS]


def _id(case) -> str:
    m, n, s, p = case
    return f"{m}-N{n}-stage{s}-{p or 'fp32'}"


# -- shard layout -----------------------------------------------------------------------
@pytest.mark.parametrize("model", ["uneven", "wide"])
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_shard_shapes(model, world, stage):
    """Rank r's shard of a parameter of d0 rows is [real rows, *shape[1:]], rows
    [r·c, r·c + c) clipped to d0, c = ceil(d0 / N); stage 0 keeps whole parameters."""
    full = shapes_of(model)
    for rank in ranks_of(model, world):
        for precision in PRECISIONS:
            shapes = run(model, world, rank, stage, precision)["shapes"]
            want = full if stage == 0 else {
                n: (owned(rows_of(s), rank, world), *s[1:]) for n, s in full.items()}
            assert shapes == want, (rank, precision)


def test_zero_row_shards_at_1024():
    """At N = 1,024 the last rank owns no row of any parameter of the uneven model, and
    rank 11 owns the last row of the 12-row ones and none of the 5-row head."""
    shapes = run("uneven", 1024, 1023, 3, None)["shapes"]
    assert all(s[0] == 0 for s in shapes.values()), shapes
    mem = run("uneven", 1024, 1023, 3, None)["memory"]
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (0, 0, 0)
    r11 = run("uneven", 1024, 11, 3, None)["shapes"]
    assert (r11["inp.weight"], r11["blocks.0.up.weight"], r11["head.weight"]) == \
        ((1, 7), (1, 12), (0, 12))


# -- memory per category ----------------------------------------------------------------
@pytest.mark.parametrize("case", cases(), ids=_id)
def test_memory_per_rank(case):
    """Every category, padding included, to the byte on every sampled rank."""
    model, world, stage, precision = case
    for rank in ranks_of(model, world):
        mem = run(model, world, rank, stage, precision)["memory"]
        want = expected_memory(model, world, rank, stage, RECIPE[precision])
        if stage == 0:  # see test_stage0_gradient_padding_is_counted
            del want["padding"]
        assert {k: mem[k] for k in want} == want, rank


@pytest.mark.parametrize("case", cases(("wide",)), ids=_id)
def test_even_shards_equal_the_plan_on_every_rank(case):
    """When every parameter's rows divide by N, each rank holds exactly the planner's
    per-GPU bytes in each category, and no padding."""
    model, world, stage, precision = case
    P = sum(math.prod(s) for s in shapes_of(model).values())
    plan = model_state_bytes(P, *planned_at(world, stage, precision))
    for rank in ranks_of(model, world):
        mem = run(model, world, rank, stage, precision)["memory"]
        assert (mem["params"], mem["grads"], mem["optimizer"]) == plan, rank
        assert mem["padding"] == 0


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_uneven_shards_sum_to_the_plan(stage, precision):
    """Uneven shards: at N = 8 each category summed over all ranks is the unsharded
    figure exactly and the planner's per-GPU figure is its ceiling share; at N = 64 and
    1,024 the per-rank formula the engine matched (test_memory_per_rank) sums to it too,
    and rank 0, which owns a whole chunk of every parameter, holds at least that share."""
    recipe = RECIPE[precision]
    shapes = list(shapes_of("uneven").values())
    P = sum(math.prod(s) for s in shapes)
    cats = ("params", "grads", "optimizer")
    per = dict(zip(cats, (recipe.weight_bytes, recipe.grad_bytes, recipe.optimizer_bytes)))
    for world in WORLDS:
        plan = dict(zip(cats, model_state_bytes(P, *planned_at(world, stage, precision))))
        sharded = {"optimizer": stage >= 1, "grads": stage >= 2, "params": stage >= 3}
        if world == 8:
            ranks = [run("uneven", 8, r, stage, precision)["memory"] for r in range(8)]
        else:
            ranks = [expected_memory("uneven", world, r, stage, recipe) for r in range(world)]
        for cat in cats:
            total = sum(m[cat] for m in ranks)
            assert total == per[cat] * P * (1 if sharded[cat] else world), (world, cat)
            assert plan[cat] == (-(-total // world) if sharded[cat] else per[cat] * P)
            rank0 = run("uneven", world, 0, stage, precision)["memory"][cat]
            assert rank0 >= plan[cat], (world, cat)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_stage0_gradient_padding_is_counted(world, precision):
    """Padding is counted, never hidden: at stage 0 (weights, master and state unpadded)
    the storages behind the full gradients hold the grads plus the padding."""
    r = run("uneven", world, 0, 0, precision)
    want = expected_memory("uneven", world, 0, 0, RECIPE[precision])
    assert r["grad_storage"] == want["grads"] + want["padding"]  # what the engine allocates
    assert r["memory"]["padding"] == want["padding"]  # what it reports


# -- communication ----------------------------------------------------------------------
@pytest.mark.parametrize("case", cases(), ids=_id)
def test_comm_per_kind(case):
    """One step's calls and bytes per collective kind, the same on every rank."""
    model, world, stage, precision = case
    want = expected_comm(model, world, stage, RECIPE[precision])
    for rank in ranks_of(model, world):
        assert run(model, world, rank, stage, precision)["comm"] == want, rank


@pytest.mark.parametrize("case", cases(), ids=_id)
def test_comm_against_the_planner(case):
    """The planner's ring bytes per step (``comm_bytes``) for the elements the layout
    moves, N·S (the parameters plus the rows that pad uneven shards; exactly the
    parameters in the wide model), plus one presence flag per parameter in every rank's
    slot of a reduction."""
    model, world, stage, precision = case
    recipe = RECIPE[precision]
    shapes = list(shapes_of(model).values())
    P, F = sum(math.prod(s) for s in shapes), len(shapes)
    wire = world * slot_numel(shapes, world)
    rb, n = recipe.reduce_bytes, world
    flags = ring_all_reduce(rb * n * F, n) if stage == 0 else ring_one_way(rb * n * F, n)
    if model == "wide":
        assert wire == P
    comm = run(model, world, 0, stage, precision)["comm"]
    assert planned_kinds(comm) == comm_bytes(wire, *planned_at(world, stage, precision)) + flags


def test_padding_on_the_wire_at_1024():
    """At N = 1,024 every parameter of the uneven model is one row per rank on the
    wire: 183 elements a slot, 187,392 in all for 3,197 parameters (58.6x), which is
    what a stage-3 step gathers twice."""
    shapes = list(shapes_of("uneven").values())
    assert (sum(math.prod(s) for s in shapes), slot_numel(shapes, 1024)) == (3197, 183)
    comm = run("uneven", 1024, 0, 3, None)["comm"]
    assert comm["all_gather"]["bytes"] == 2 * 1023 * 183 * 4


def test_stage3_sends_one_and_a_half_times_ddp_at_1024():
    """Even shards, fp32, flags aside: 3Ψ against DDP's 2Ψ (ZeRO paper, section 7)."""
    n, F = 1024, len(shapes_of("wide"))
    sent = {s: planned_kinds(run("wide", n, 0, s, None)["comm"]) for s in (0, 3)}
    sent[0] -= ring_all_reduce(4 * n * F, n)
    sent[3] -= ring_one_way(4 * n * F, n)
    assert sent[3] * 2 == sent[0] * 3


# -- checkpoint rows across N -----------------------------------------------------------
def _held(world: int, rank: int, stage: int) -> dict[str, tuple[int, int, tuple]]:
    """What ``load`` would read into on rank r of N: each entry's full rows [a, b), and
    the public shard shape."""
    from zeroshard.checkpoint.sharded import entries

    with fake_world(world, rank):
        net = zs.shard(Uneven(), stage=stage)
        out = {e.name: e.held() for e in entries(net)}
        shapes = {n: tuple(p.shape) for n, p in net.named_parameters()}
        del net
    return {n: (*out[n], shapes[n]) for n in out}


def _manifest(world: int) -> dict:
    """The row ranges a checkpoint written at ``world`` ranks records, rank file by rank
    file (``save`` skips the parameters of which a rank holds no row)."""
    from zeroshard.checkpoint.sharded import own_rows

    files = {}
    for k in range(world):
        rows = {}
        for name, shape in shapes_of("uneven").items():
            a, b = own_rows(rows_of(shape), k, world)
            assert (a, b) == chunk(rows_of(shape), k, world)
            if a < b:
                rows[name] = [a, b]
        files[f"rank{k:05d}.safetensors"] = {"rows": rows}
    return {"files": files}


def _expected_pieces(a: int, b: int, rows: int, written: int) -> list[tuple]:
    """Row by row: full row i is row i - k·c of rank k's file, k = i // c, c =
    ceil(rows / written); consecutive rows from one file form one piece."""
    c = -(-rows // written)
    pieces: list[list] = []
    for i in range(a, b):
        k = i // c
        if pieces and pieces[-1][0] == k:
            pieces[-1][2] += 1
            pieces[-1][4] += 1
        else:
            pieces.append([k, i - k * c, i - k * c + 1, i - a, i - a + 1])
    return [(f"rank{k:05d}.safetensors", *rest) for k, *rest in pieces]


@pytest.mark.parametrize("written,read", [(1024, 8), (8, 1024)])
@pytest.mark.parametrize("stage", [0, 3])
def test_checkpoint_rows_across_worlds(written, read, stage):
    """A checkpoint written at one N is read at another: every rank's rows come from
    exactly the files that hold them, in order, with nothing missing; a rank with no rows
    reads nothing. Sampled ranks are built over the fake group (what ``load`` reads
    into); at 1,024 every rank's rows are the dim-0 chunk those ranks were checked to hold."""
    from zeroshard.checkpoint.load import _pieces

    manifest = _manifest(written)
    full = shapes_of("uneven")
    sampled = range(read) if read == 8 else (0, 1, 11, read - 1)
    built = {r: _held(read, r, stage) for r in sampled}
    for r in range(read):
        for name, shape in full.items():
            R = rows_of(shape)
            a, b = (0, R) if stage == 0 else chunk(R, r, read)
            if r in built:
                ha, hb, shard = built[r][name]
                assert hb - ha == shard[0] == b - a, (r, name)
                if hb > ha:
                    assert (ha, hb) == (a, b), (r, name)
            got = _pieces(manifest, name, a, b)
            assert got == _expected_pieces(a, b, R, written), (r, name)
            assert sum(p[2] - p[1] for p in got) == b - a


def test_checkpoint_writers_hold_what_they_write():
    """Rank k of N writes rows ``own_rows(d0, k, N)`` of each parameter: at stage >= 1
    exactly the rows its shard holds, at N = 8 and 1,024."""
    from zeroshard.checkpoint.sharded import own_rows

    for world, ranks in ((8, (0, 5, 7)), (1024, (0, 11, 39, 1023))):
        for r in ranks:
            for name, (a, b, shape) in _held(world, r, 2).items():
                wa, wb = own_rows(rows_of(shapes_of("uneven")[name]), r, world)
                assert (b - a, shape[0]) == (wb - wa, wb - wa), (world, r, name)
                if wb > wa:
                    assert (a, b) == (wa, wb), (world, r, name)
