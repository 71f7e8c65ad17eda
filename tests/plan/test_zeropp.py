"""The planner under ZeRO++ (hpZ, qwZ, qgZ) against the engine's ledger.

``ENGINE`` is what the engine recorded at N = 4 (gloo, fp32 AdamW, :class:`Quad`: the
input layer and head in the root unit, three blocks as units, every row count divisible
by 4, so nothing is padded), one step after a first: bytes per level and kind, and the
weights every rank keeps between its forward and its backward (``gathered`` in
``unit.readout.memory(u)``, hpZ's secondary shards). The unit tests replay it against
``comm_bytes_by_level`` and ``secondary_bytes`` (and the peak's ``secondary``), plus
the presence flags the engine adds to each reduced slot (one per parameter, which the
plan leaves out: under qgZ they travel inside the quantized slot).
``test_engine_still_records_these`` spawns the engine and checks the record (about 10 s).
"""

import json

import pytest

from zeroshard.cli import main
from zeroshard.plan import (
    ModelSpec,
    ParallelDims,
    Workload,
    ZeroConfig,
    get_preset,
    get_recipe,
    plan_all,
)
from zeroshard.plan.comm import quantized_nbytes
from zeroshard.plan.hardware import Cluster, get_accelerator, get_network
from zeroshard.plan.memory import (
    comm_bytes,
    comm_bytes_by_level,
    model_state_bytes,
    ring_all_reduce,
    ring_one_way,
    secondary_bytes,
    unit_sizes,
)
from zeroshard.plan.peak import peak
from zeroshard.plan.steptime import Schedule, ring_time, step_time

FP32 = get_recipe("fp32-adamw")
N, BLOCK = 4, 8
#: Quad's units: the root (6·8 + 8 + 8·4 + 4 = 92), three blocks (8·8 + 8 + 2·8 = 88).
UNITS, FLAGS = [92, 88, 88, 88], 4
P = sum(UNITS)
#: name: the engine's ZeroConfig options (stage, shard group, ZeRO++)
CASES = {
    "hpz": dict(stage=3, secondary_group=2),
    "hpz_qwz_qgz": dict(stage=3, secondary_group=2, quantize_weights=True,
                        quantize_grads=True, quant_block=BLOCK),
    "groups_qwz_qgz": dict(stage=3, shard_group=2, quantize_weights=True,
                           quantize_grads=True, quant_block=BLOCK),
    "groups_qgz_stage2": dict(stage=2, shard_group=2, quantize_grads=True,
                              quant_block=BLOCK),
}


def _options(name: str) -> dict:
    return {"shard_group": None, **CASES[name]}


def planned_at(name: str, recipe=FP32) -> tuple[ParallelDims, ZeroConfig]:
    """The layout and the configuration the planner plans case ``name`` at: the engine's
    options, its fp32 recipe taken whole."""
    z = ZeroConfig(mixed_precision=recipe, **CASES[name])
    return ParallelDims(N, shard=z.shard_group), z


def config(recipe, stage=3, **options) -> ZeroConfig:
    return ZeroConfig(stage=stage, mixed_precision=recipe, **options)


def _grid() -> dict:
    """On each rank, per case: the second step's bytes per level and kind, the weights
    kept between its forward and its backward, memory per category at the step, and
    each unit's (weight slot, reduced slot, trainable parameters)."""
    import torch
    import torch.nn.functional as F

    import zeroshard as zs
    from zeroshard.runtime.unit import memory as unit_memory

    from ..engine import engine_cases as cases
    from .test_hybrid import step_seeing_memory

    class Quad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(6, 8)
            self.blocks = torch.nn.ModuleList(cases.Block(8) for _ in range(3))
            self.head = torch.nn.Linear(8, 4)

        def forward(self, x, y):
            h = self.inp(x)
            for b in self.blocks:
                h = b(h)
            return F.mse_loss(self.head(h), y)

    out = {}
    for name in CASES:
        torch.manual_seed(0)
        net = zs.shard(Quad(), units="blocks", **_options(name))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(3, 6, generator=g), torch.randn(3, 4, generator=g)
            net.comm_stats(reset=True)
            loss = net(x, y)
            kept = sum(unit_memory(u)["gathered"] for u in net.units)
            loss.backward()
            seen = step_seeing_memory(net, opt)
        levels = net.comm_stats(by_level=True)
        out[name] = {
            "kept": kept,
            "memory": {c: seen[c] for c in ("params", "grads", "optimizer", "padding")},
            "units": [(u.w_layout.slot_numel, u.r_layout.slot_numel, len(u.trainable))
                      for u in net.units],
            **{lv: {kind: v["bytes"] for kind, v in levels[lv].items()}
               for lv in ("inside", "across", "secondary") if lv in levels}}
    return out


#: What the engine recorded (every rank alike): per case, the weights kept from forward
#: to backward, memory per category at the step, each unit's (weight slot, reduced slot,
#: trainable parameters), and bytes per level and kind.
ENGINE = {
    "hpz": {"kept": 712, "memory": {"params": 356, "grads": 356, "optimizer": 712,
                                    "padding": 0},
            "units": [(23, 23, 4), (22, 22, 4), (22, 22, 4), (22, 22, 4)],
            "inside": {"all_gather": 1068, "reduce_scatter": 1260},
            "secondary": {"all_gather": 712}},
    "hpz_qwz_qgz": {"kept": 712, "memory": {"params": 356, "grads": 356, "optimizer": 712,
                                            "padding": 0},
                    "units": [(23, 23, 4), (22, 22, 4), (22, 22, 4), (22, 22, 4)],
                    "inside": {"all_gather": 411, "reduce_scatter": 507},
                    "secondary": {"all_gather": 712}},
    "groups_qwz_qgz": {"kept": 0, "memory": {"params": 712, "grads": 712, "optimizer": 1424,
                                             "padding": 0},
                       "units": [(46, 46, 4), (44, 44, 4), (44, 44, 4), (44, 44, 4)],
                       "inside": {"all_gather": 548, "reduce_scatter": 294},
                       "across": {"all_reduce": 776}},
    "groups_qgz_stage2": {"kept": 0, "memory": {"params": 1424, "grads": 712,
                                                "optimizer": 1424, "padding": 0},
                          "units": [(46, 46, 4), (44, 44, 4), (44, 44, 4), (44, 44, 4)],
                          "inside": {"all_gather": 712, "reduce_scatter": 294},
                          "across": {"all_reduce": 776}},
}


def flag_bytes(name: str) -> dict[str, int]:
    """The presence flags' bytes per level: F flags per unit in each of the K slots of
    its reduce-scatter (qgZ: inside the quantized slot of n + F elements, so they may add
    a scale), and each rank's F all-reduced across the R replicas."""
    _, z = planned_at(name)
    k = z.shard_group or N
    r, out = FP32.reduce_bytes, {"inside": 0, "across": 0}
    for u in UNITS:
        n = u // k
        if z.quantize_grads:
            b = z.quant_block
            out["inside"] += (k - 1) * (quantized_nbytes(n + FLAGS, b) - quantized_nbytes(n, b))
        else:
            out["inside"] += ring_one_way(r * k * FLAGS, k)
        out["across"] += ring_all_reduce(r * FLAGS, N // k)
    return out


def test_the_record_is_unpadded():
    for name, options in CASES.items():
        k = options.get("shard_group") or N
        assert all(u % k == 0 for u in UNITS)
        assert ENGINE[name]["units"] == [(u // k, u // k, FLAGS) for u in UNITS]
        assert ENGINE[name]["memory"]["padding"] == 0


@pytest.mark.parametrize("name", CASES)
def test_bytes_per_level_are_the_planners_plus_flags(name):
    dims, z = planned_at(name)
    planned = comm_bytes_by_level(P, dims, z, UNITS)
    flags = flag_bytes(name)
    levels = [lv for lv in ("inside", "across", "secondary") if lv in ENGINE[name]]
    assert sorted(planned) == sorted(["inside", "across"] + (
        ["secondary"] if z.secondary_group else []))
    for level in ("inside", "across", "secondary"):
        measured = sum(ENGINE[name].get(level, {}).values())
        assert measured == planned.get(level, 0) + flags.get(level, 0), level
    assert set(levels) <= set(planned)
    assert comm_bytes(P, dims, z, UNITS) == sum(planned.values())


@pytest.mark.parametrize("name", CASES)
def test_memory_is_the_planners(name):
    """Per category at K, and the secondary shards every rank keeps from the forward to
    the backward: K/K2 of each unit's K slots."""
    dims, z = planned_at(name)
    weights, grads, optimizer = model_state_bytes(P, dims, z)
    memory = ENGINE[name]["memory"]
    assert (memory["params"], memory["grads"], memory["optimizer"]) == (weights, grads,
                                                                      optimizer)
    kept = secondary_bytes(P, dims, z, UNITS)
    assert ENGINE[name]["kept"] == sum(kept)
    assert (len(kept) == len(UNITS)) == (z.secondary_group is not None)


def test_levels_by_hand_70b_on_64():
    """Llama-2-70B (bf16, r = w = 2) on 64 GPUs, plain ZeRO-3: hpZ in nodes of 8 moves
    the backward's gathers into the node, 7/8 of 2P, and keeps 2P/8 per GPU; qwZ and
    qgZ send about half of bf16's bytes in the forward gathers and the reduction."""
    model = ModelSpec.from_arch(get_preset("llama2-70b"))
    p, bf16, units = model.params, get_recipe("bf16-mixed-adamw"), unit_sizes(model)
    assert sum(units) == p and len(units) == 81
    slots = [-(-u // 64) for u in units]
    on64 = ParallelDims(64)
    hpz = comm_bytes_by_level(p, on64, config(bf16, secondary_group=8), units)
    assert hpz == {"inside": 2 * ring_one_way(2 * p, 64),
                   "across": 0,
                   "secondary": sum(ring_one_way(64 * n * 2, 8) for n in slots)}
    assert sum(secondary_bytes(p, on64, config(bf16, secondary_group=8), units)) == sum(
        8 * n * 2 for n in slots)
    both = comm_bytes_by_level(p, on64, config(bf16, secondary_group=8, quantize_weights=True,
                                               quantize_grads=True), units)
    q = sum(63 * (n + 4 * -(-n // 2048)) for n in slots)
    assert both == {"inside": 2 * q, "across": 0, "secondary": hpz["secondary"]}
    z3 = comm_bytes(p, on64, config(bf16))
    assert round(z3 / 1e9, 2) == 407.39 and round(sum(hpz.values()) / 1e9, 2) == 392.30
    assert round(sum(both.values()) / 1e9, 2) == 256.77


def test_plans_and_peaks_take_what_each_stage_takes():
    model = ModelSpec.from_arch(get_preset("llama2-70b"))
    bf16 = get_recipe("bf16-mixed-adamw")
    z = config(bf16, secondary_group=8, quantize_weights=True, quantize_grads=True)
    on64 = ParallelDims(64)
    plans = plan_all(model, on64, z, Workload(), 80 * 10**9)
    plain = plan_all(model, on64, config(bf16), Workload(), 80 * 10**9)
    took = [(p.config.secondary_group, p.config.quantize_weights, p.config.quantize_grads)
            for p in plans]
    assert took == [(None, False, False), (None, False, True), (None, False, True),
                    (8, True, True)]
    assert plans[0] == plain[0]  # DDP takes nothing
    assert plans[3].total == plain[3].total + plans[3].secondary
    assert round(plans[3].secondary / 1e9, 2) == 17.24  # 2P/8
    assert plans[3].comm_inside + plans[3].comm_secondary == plans[3].comm
    q = peak(model, on64, z, Workload())
    base = peak(model, on64, config(bf16), Workload())
    assert q.secondary == plans[3].secondary
    assert q.phases["loss backward"] == base.phases["loss backward"] + q.secondary
    # through the block units' backward the root unit's and the units not yet done
    root, unit = (8 * 2 * -(-n // 64) for n in (model.arch.root_params,
                                                model.arch.block_params))
    assert q.blocks.at == base.blocks.at == "unit 78 begin"  # two of 80 block units done
    assert q.blocks.bytes == base.blocks.bytes + root + 78 * unit
    assert q.end.at == base.end.at == "unit 0 end"
    assert q.end.bytes == base.end.bytes + root
    assert q.phases["optimizer step"] == base.phases["optimizer step"]
    assert peak(model, on64, z.at_stage(2), Workload()) == peak(
        model, on64, config(bf16, stage=2), Workload())


def test_step_time_puts_secondary_gathers_on_the_node_link():
    model = ModelSpec.from_arch(get_preset("llama2-70b"))
    bf16 = get_recipe("bf16-mixed-adamw")
    cluster = Cluster(get_accelerator("h100"), get_network("nvlink4-ndr"), 8)
    work, on64 = Workload(), ParallelDims(64)
    plain = step_time(model, on64, config(bf16), work, cluster)
    hpz = step_time(model, on64, config(bf16, secondary_group=8), work, cluster, Schedule())
    q = model.params / 80
    assert hpz.secondary == pytest.approx(80 * ring_time("all_gather", 2 * q, 8,
                                                         cluster.link(8)))
    assert plain.secondary == 0 and hpz.comm < plain.comm
    quant = step_time(model, on64, config(bf16, quantize_weights=True, quantize_grads=True),
                      work, cluster)
    assert quant.comm < plain.comm and quant.copies > plain.copies


@pytest.mark.parametrize("stage,z,reduce", [
    (2, dict(secondary_group=2), None),
    (1, dict(quantize_weights=True), None),
    (0, dict(quantize_grads=True), None),
    (3, dict(quantize_grads=True), "fp32"),
])
def test_refusals_are_the_engines(stage, z, reduce, capsys):
    """The planner refuses what ``ZeroConfig`` refuses, in its words: the engine's
    configuration, the planner's (its recipe whole, reduced in ``reduce``) and the
    command line's."""
    import zeroshard as zs

    with pytest.raises(ValueError) as engine:
        zs.ZeroConfig(stage=stage, reduce_dtype=reduce, **z)
    recipe = FP32.with_reduce_dtype(reduce)
    with pytest.raises(ValueError) as plan:
        comm_bytes_by_level(P, ParallelDims(N), config(recipe, stage, **z))
    assert str(plan.value) == str(engine.value)
    flags = {"secondary_group": ["--hpz", "2"], "quantize_weights": ["--quantize-weights"],
             "quantize_grads": ["--quantize-grads"]}
    argv = [a for k in z for a in flags[k]] + ["--strategy", str(stage)] + (
        ["--reduce-dtype", reduce] if reduce else [])
    assert main(["plan", "--precision", "fp32-adamw", *argv]) == 2
    assert str(engine.value) in capsys.readouterr().err


def test_a_secondary_group_that_does_not_divide_is_the_engines_refusal():
    from zeroshard.spec.dims import ParallelDims

    with pytest.raises(ValueError) as engine:
        ParallelDims(4, secondary=3)
    with pytest.raises(ValueError) as plan:
        comm_bytes_by_level(P, ParallelDims(N), config(FP32, secondary_group=3))
    assert str(plan.value) == str(engine.value)
    with pytest.raises(ValueError) as layout:  # the layout's own check, the same words
        ParallelDims(N, secondary=3)
    assert str(layout.value) == str(engine.value)
    assert comm_bytes_by_level(P, ParallelDims(N), config(FP32, secondary_group=4)) == (
        comm_bytes_by_level(P, ParallelDims(N), config(FP32)))  # K2 = K: nothing kept


def test_cli_json_and_table(capsys):
    assert main(["plan", "--model", "llama2-70b", "--gpus", "64", "--hpz", "8",
                 "--quantize-weights", "--quantize-grads", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["zeropp"] == {"hpz": 8, "quantize_weights": True, "quantize_grads": True,
                             "quant_block": 2048}
    z3 = out["strategies"][3]
    assert (z3["hpz"], z3["quantize_weights"], z3["quantize_grads"]) == (8, True, True)
    assert z3["comm"] == z3["comm_inside"] + z3["comm_across"] + z3["comm_secondary"]
    assert z3["peak"]["secondary"] == z3["secondary"] > 0
    assert out["strategies"][1]["hpz"] is None and out["strategies"][1]["quantize_grads"]
    assert main(["plan", "--model", "llama2-70b", "--gpus", "64", "--hpz", "8", "--time",
                 "--strategy", "ZeRO-3"]) == 0
    text = capsys.readouterr().out
    assert "hpZ in groups of 8 (17.24 GB kept" in text.replace("\n", " ")
    assert "secondary" in text


@pytest.mark.parametrize("argv,message", [
    (["--hpz", "2", "--strategy", "ZeRO-2"], "secondary_group=2 (hpZ) keeps gathered"),
    (["--hpz", "3"], "secondary_group=3 does not divide the shard group's 8 ranks; "
                     "expected one of [1, 2, 4, 8]"),
    (["--quantize-grads", "--reduce-dtype", "fp32"], "reduce_dtype='fp32' asks for another"),
    (["--quantize-weights", "--recommend"], "--recommend does not weigh hpZ"),
    (["--hpz", "2", "--min-gpus"], "--min-gpus searches GPU counts for plain ZeRO-3"),
    (["--quant-block", "64"], "--quant-block=64 needs --quantize-weights"),
    (["--quantize-weights", "--quant-block", "0"], "quant_block=0 must be an integer >= 1"),
])
def test_bad_zeropp_flags_are_one_line(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.dist
def test_engine_still_records_these():
    from zeroshard.runtime.spawn import spawn

    for rank in spawn(_grid, N, timeout=300):
        for record in rank.values():
            record["units"] = [tuple(u) for u in record["units"]]
        assert rank == ENGINE
