"""Hybrid sharding on real gloo ranks, N = 4 as 2 shard groups of 2 (and the degenerate
1 x 4 and 4 x 1): every stage within 1e-6 of torch DDP after 8 AdamW steps, the stages
of one grouping bit for bit equal to each other; memory per category is the planner's
at K ranks; bytes per level are the collectives' own."""

import pytest

import zeroshard as zs
from zeroshard.plan import ParallelDims, ZeroConfig, get_recipe, model_state_bytes
from zeroshard.plan.memory import comm_bytes, ring_all_reduce
from zeroshard.runtime.spawn import spawn
from zeroshard.runtime.unit import memory as unit_memory

from . import engine_cases as cases

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # a scale-out grid

GROUPINGS = (2, 1, 4)  # K: ranks per shard group (N = 4)


def _one_step(net, opt):
    """Memory at the step (every category live) and bytes per level of one step."""
    net.comm_stats(reset=True)
    net(*cases.batch("mlp", 99)).backward()
    seen = []
    hook = opt.register_step_pre_hook(lambda o, a, k: seen.append(net.memory(o)))
    opt.step()
    hook.remove()
    opt.zero_grad()
    return seen[0], net.comm_stats(by_level=True)


def _grid():
    ref = cases.train("mlp", "ddp", steps=8)[0]
    out = {}
    for k in GROUPINGS:
        for stage in range(4):
            # stage 0 unit by unit, as stages 1-3 reduce (its default bucket sums four
            # ranks in another order: test_reduction.py)
            weights, _, net, opt = cases.train("mlp", stage, steps=8, shard_group=k,
                                               bucket=0 if stage == 0 else None)
            memory, levels = _one_step(net, opt)
            slots = [(u.r_layout.slot_numel, len(u.trainable), u.w_layout.slot_numel,
                      u.g_layout.slot_numel) for u in net.units]
            out[(k, stage)] = {"diff": cases.max_rel_diff(weights, ref), "weights": weights,
                               "memory": memory, "levels": levels, "slots": slots}
        # and stage 0 at its default, DDP's bucket (the whole MLP in one all-reduce)
        out[(k, "bucketed")] = cases.max_rel_diff(
            cases.train("mlp", 0, steps=8, shard_group=k)[0], ref)
    return out


@pytest.fixture(scope="module")
def grid():
    return spawn(_grid, 4, timeout=600)


@pytest.mark.parametrize("k", GROUPINGS)
def test_every_stage_matches_ddp(grid, k):
    for stage in range(4):
        assert grid[0][(k, stage)]["diff"] < cases.TOL, (k, stage, grid[0][(k, stage)]["diff"])
    assert grid[0][(k, "bucketed")] < cases.TOL, (k, grid[0][(k, "bucketed")])


@pytest.mark.parametrize("k", GROUPINGS)
def test_stages_of_one_grouping_are_bit_for_bit_equal(grid, k):
    for r in grid:
        assert all(cases.bit_equal(r[(k, s)]["weights"], r[(k, 0)]["weights"])
                   for s in range(1, 4))
    # and the replicas agree: rank r and rank r + K hold the same weights
    assert all(cases.bit_equal(grid[r][(k, 3)]["weights"], grid[0][(k, 3)]["weights"])
               for r in range(4))


def test_the_two_level_sum_is_the_flat_sum_at_two_ranks_a_level(grid):
    """2 x 2: each level adds two numbers, so the same bits as plain ZeRO over 4 (1 x 4
    adds the same four numbers in a ring of four: not always the same bits)."""
    assert cases.max_rel_diff(grid[0][(2, 3)]["weights"], grid[0][(4, 3)]["weights"]) < 1e-6


@pytest.mark.parametrize("k", GROUPINGS)
@pytest.mark.parametrize("stage", range(4))
def test_memory_per_category_is_the_planners_at_k_ranks(grid, k, stage):
    """A sharded category: each shard group holds it once in all (the planner's
    per-rank figure is that over K, rounded up; rows divide unevenly over 4); a whole
    one: every rank holds all of it."""
    params = sum(p.numel() for p in cases.build("mlp").parameters())
    config = ZeroConfig(stage=stage, mixed_precision=get_recipe("fp32-adamw"))
    planned = model_state_bytes(params, ParallelDims(k), config)
    totals = model_state_bytes(params, ParallelDims(1), config)
    for cat, plan, total in zip(("params", "grads", "optimizer"), planned, totals):
        got = [grid[r][(k, stage)]["memory"][cat] for r in range(4)]
        if plan == total:
            assert got == [total] * 4, (cat, got)
        else:
            assert plan == -(-total // k)
            assert [sum(got[g * k:(g + 1) * k]) for g in range(4 // k)] == [total] * (4 // k), (
                cat, got)


@pytest.mark.parametrize("k", GROUPINGS)
@pytest.mark.parametrize("stage", range(4))
def test_bytes_per_level(grid, k, stage):
    """Inside the shard groups: each unit's reduction of K padded slots plus one presence
    flag per parameter in each, and its gathers (stages 1-2 after the step, stage 3
    twice) — the planner's bytes for K ranks plus the flags where nothing is padded;
    across them: one all-reduce of each reduced slot (stage 0: of the whole buffer) over
    the R = 4 / K replicas."""
    from zeroshard.plan.memory import ring_one_way

    r = grid[0][(k, stage)]
    levels, slots = r["levels"], r["slots"]
    if stage == 0:
        want = sum(ring_all_reduce(4 * k * (s + f), k) for s, f, _, _ in slots)
    else:
        gathers = [2 * w if stage == 3 else g for _, _, w, g in slots]
        want = sum(ring_one_way(4 * k * (s + f), k) for s, f, _, _ in slots) + sum(
            ring_one_way(4 * k * w, k) for w in gathers)
    inside = sum(v["bytes"] for v in levels.get("inside", {}).values())
    assert inside == want, levels
    params = sum(p.numel() for p in cases.build("mlp").parameters())
    if k * sum(s for s, _, _, _ in slots) == params:  # nothing padded: the planner's
        flags = sum(f for _, f, _, _ in slots) * 4 * (k - 1) * (2 if stage == 0 else 1)
        config = ZeroConfig(stage=stage, mixed_precision=get_recipe("fp32-adamw"))
        assert inside == comm_bytes(params, ParallelDims(k), config) + flags
    reps = 4 // k
    across = levels.get("across", {})
    if reps == 1:
        assert not across, levels
        return
    width = [(s + f) * (k if stage == 0 else 1) for s, f, _, _ in slots]
    assert across == {"all_reduce": {"calls": len(slots), "bytes": sum(
        ring_all_reduce(4 * w, reps) for w in width)}}, levels


def _bad_groups():
    """A group size that does not divide N, a mesh with other dims; a real 2 x 2 mesh
    with the right dims is hybrid sharding over its shard dim."""
    from torch.distributed.device_mesh import init_device_mesh

    out = []
    for spec in (3, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))):
        try:
            zs.shard(cases.build("mlp"), stage=3, shard_group=spec)
            out.append("accepted")
        except ValueError as exc:
            out.append(str(exc))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    net = zs.shard(cases.build("mlp"), stage=3, shard_group=mesh)
    out.append((net.mesh.shard_world, net.mesh.replica_world))
    return out


def test_bad_groups_are_named_and_a_mesh_is_taken():
    bad, mesh, good = spawn(_bad_groups, 4, timeout=120)[0]
    assert "shard_group=3 gives shard groups of 3 ranks, which do not divide the 4 " \
           "data-parallel ranks; expected one of [1, 2, 4]" in bad, bad
    assert "shard_group: a DeviceMesh with dims ('dp', 'tp'); expected dims ('replicate', " \
           "'shard')" in mesh, mesh
    assert good == (2, 2)
    with pytest.raises(ValueError, match=r"shard_group=0; expected None, an integer >= 1"):
        zs.ZeroConfig(shard_group=0)


@pytest.mark.slow  # torchrun's two nodes, whole programs; the groups: test_every_stage_matches_ddp
def test_two_nodes_of_two_train_sharded_per_node(tmp_path):
    """``zeroshard train --shard-group node`` under torchrun with two nodes of two
    processes, both started on this machine (node ranks from the rendezvous): each node
    is a shard group (K = LOCAL_WORLD_SIZE = 2), replicated across the two."""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
           "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--rdzv-id", "hybrid-test", "-m", "zeroshard", "train",
           "--model", "tiny", "--steps", "4", "--batch", "8", "--eval-every", "100",
           "--sample-chars", "0", "--shard-group", "node", "--json-log", str(log)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for _ in range(2)]
    outs = [n.communicate(timeout=240)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["loss"] == r["loss"] and r["loss"] < 6 for r in rows), rows
    assert "4 processes" in "".join(outs), outs


def _gpt(stage, k=None):
    net = zs.shard(cases.build("gpt"), stage=stage, shard_group=k)
    return net, cases.make_optimizer("groups", net.named_parameters(), 1e-3)


def _train_steps(net, opt, steps):
    for s in steps:
        net(*cases.batch("gpt", s)).backward()
        opt.step()
        opt.zero_grad()


def _checkpoints_across_groupings(root: str):
    """Hybrid (2 x 2, stage 3) saves; plain ZeRO-1 over 4 loads it; plain saves; hybrid
    (2 x 2, stage 2) loads that: weights and one more step equal to the saver's."""
    import os

    out = {}
    net, opt = _gpt(3, k=2)
    _train_steps(net, opt, range(3))
    zs.save(net, opt, os.path.join(root, "hybrid"), extra={"step": 3})
    out["hybrid"] = net.full_state_dict()
    _train_steps(net, opt, [3])
    out["hybrid+1"] = net.full_state_dict()
    plain, popt = _gpt(1)
    zs.load(plain, popt, os.path.join(root, "hybrid"))
    out["plain loaded"] = plain.full_state_dict()
    _train_steps(plain, popt, [3])
    out["plain+1"] = plain.full_state_dict()
    zs.save(plain, popt, os.path.join(root, "plain"), extra={"step": 4})
    again, aopt = _gpt(2, k=2)
    zs.load(again, aopt, os.path.join(root, "plain"))
    out["hybrid loaded"] = again.full_state_dict()
    return out


def _load_at_two(root: str):
    import os

    net, opt = _gpt(0)
    zs.load(net, opt, os.path.join(root, "hybrid"))
    return net.full_state_dict()


def test_checkpoints_load_across_groupings_n_and_stages(tmp_path):
    import json

    r = spawn(_checkpoints_across_groupings, 4, str(tmp_path), timeout=300)[0]
    assert cases.bit_equal(r["plain loaded"], r["hybrid"])
    # one more step: the loaded optimizer state is the saver's (sums differ in order)
    assert cases.max_rel_diff(r["plain+1"], r["hybrid+1"]) < 1e-6
    assert cases.bit_equal(r["hybrid loaded"], r["plain+1"])
    manifest = json.loads((tmp_path / "hybrid" / "manifest.json").read_text())
    assert manifest["world"] == 2 and sorted(manifest["files"]) == [
        "rank00000.safetensors", "rank00001.safetensors"]  # one shard group wrote
    assert cases.bit_equal(spawn(_load_at_two, 2, str(tmp_path), timeout=120)[0], r["hybrid"])


def _hpz():
    """Stage 3 over 4 with secondary groups of 2 (hpZ), against plain stage 3 (10 AdamW
    steps); and the ledger's backward gathers inside the secondary group."""
    out = {}
    for k2 in (None, 2):
        net = zs.shard(cases.build("mlp"), stage=3, secondary_group=k2)
        opt = cases.make_optimizer("adamw", net.named_parameters(), 1e-2)
        for step in range(10):
            net(*cases.batch("mlp", step)).backward()
            opt.step()
            opt.zero_grad()
        weights = net.full_state_dict()
        net.comm_stats(reset=True)
        loss = net(*cases.batch("mlp", 99))
        kept = sum(unit_memory(u)["gathered"] for u in net.units)  # between forward and backward
        loss.backward()
        opt.step()
        opt.zero_grad()
        out[k2] = {"weights": weights, "levels": net.comm_stats(by_level=True),
                   "slots": [u.w_layout.slot_numel for u in net.units], "kept": kept}
    return out


def test_hpz_gathers_backward_inside_the_secondary_group():
    from zeroshard.plan.memory import ring_one_way

    r = spawn(_hpz, 4, timeout=300)
    for rank in r:  # the same bits as plain stage 3 (itself within 1e-6 of DDP, above)
        assert cases.bit_equal(rank[2]["weights"], rank[None]["weights"])
    levels, slots = r[0][2]["levels"], r[0][2]["slots"]
    # forward: every unit gathered over the 4; backward: over the 2 of the secondary group
    assert levels["inside"]["all_gather"] == {
        "calls": len(slots), "bytes": sum(ring_one_way(4 * 4 * s, 4) for s in slots)}
    assert levels["secondary"]["all_gather"] == {
        "calls": len(slots), "bytes": sum(ring_one_way(4 * 4 * s, 2) for s in slots)}
    assert r[0][None]["levels"]["inside"]["all_gather"]["calls"] == 2 * len(slots)
    # after the forward each rank keeps half of every unit's 4 slots for its backward
    assert r[0][2]["kept"] == sum(4 * 2 * s for s in slots) and r[0][None]["kept"] == 0


def test_hpz_needs_stage_3_and_a_divisor():
    with pytest.raises(ValueError, match=r"secondary_group=2 \(hpZ\) keeps gathered weights "
                                         r"between forward and backward, which only stage 3"):
        zs.ZeroConfig(stage=2, secondary_group=2)
    from zeroshard.spec.dims import ParallelDims

    with pytest.raises(ValueError, match=r"secondary_group=3 does not divide the shard "
                                         r"group's 4 ranks; expected one of \[1, 2, 4\]"):
        ParallelDims(4, secondary=3)


def _hpz_forward_without_backward():
    """A forward with gradients enabled and no backward (an evaluation that forgot
    no_grad) leaves hpZ's secondary copies behind; new weights are then loaded. The
    next forward must gather the new weights, not the stale copies."""
    out = {}
    fresh = {k: v + 0.5 for k, v in cases.build("mlp").state_dict().items()}
    for k2 in (None, 2):
        net = zs.shard(cases.build("mlp"), stage=3, secondary_group=k2)
        opt = cases.make_optimizer("adamw", net.named_parameters(), 1e-2)
        net(*cases.batch("mlp", 0))  # no backward
        net.load_state_dict(fresh)
        for step in range(2):
            net(*cases.batch("mlp", step)).backward()
            opt.step()
            opt.zero_grad()
        out[k2] = net.full_state_dict()
    return out


def test_hpz_never_gathers_a_stale_secondary_copy():
    for r in spawn(_hpz_forward_without_backward, 4, timeout=120):
        assert cases.bit_equal(r[2], r[None])
