"""The step-time model, tensor parallelism in the planner, and --recommend."""

import json
import subprocess
import sys

import pytest

from zeroshard.cli import main
from zeroshard.plan import (
    ModelSpec,
    ParallelDims,
    Workload,
    ZeroConfig,
    get_preset,
    get_recipe,
    plan_strategy,
)
from zeroshard.plan.hardware import Accelerator, Cluster, Link, Network, get_network
from zeroshard.plan.memory import (
    activation_bytes,
    comm_bytes,
    model_state_bytes,
    ring_all_reduce,
    tp_comm_bytes,
)
from zeroshard.plan.peak import peak
from zeroshard.plan.recommend import HEADROOM, Candidate, choose, recommend
from zeroshard.plan.steptime import (
    Schedule,
    StepTime,
    copy_bytes,
    ring_time,
    step_time,
    train_flops_per_token,
)

BF16 = get_recipe("bf16-mixed-adamw")
MS = 1e-3
ON2, ON8 = ParallelDims(2), ParallelDims(8)


def config(stage: int = 3, recipe=BF16, **options) -> ZeroConfig:
    """The planner's configuration: ``recipe`` taken whole (reduced in its own dtype)."""
    return ZeroConfig(stage=stage, mixed_precision=recipe, **options)

# A toy cluster where every number is round: 4 layers of 250,000 parameters (P = 10^6),
# h = 1 and s = 1 so attention adds 4·L·h·s = 16 FLOPs per token, 1,000 tokens per
# micro-batch, a rate that makes one unit's forward F = 0.5 ms (backward 1 ms), and a
# 1 GB/s link without latency between 2 ranks: a unit's bf16 weights (500 kB) gather in
# G = 0.25 ms, its gradients reduce-scatter in 0.25 ms and all-reduce in 0.5 ms. Memory
# moves 1 TB/s, so the engine's copies take 1 µs per MB: visible, never reordering.
TOY = ModelSpec("toy", 10**6, hidden=1, layers=4)
WORK = Workload(1000, seq_len=1, checkpointing=False)
RATE = (2 * 10**6 + 16) * 1000 / 4 / (0.5 * MS)
MEM_BW = 1e12
TOY_LINK = Link("toy", 1e9, 0.0)
TOY_CLUSTER = Cluster(Accelerator("toy", RATE, MEM_BW, efficiency=1.0),
                      Network("toy", TOY_LINK, TOY_LINK))
# Copy seconds per unit, by hand (CopyBytes): Q = 250,000 bf16 parameters (w = g = r = 2,
# fp32 master m = 4) over N = 2 ranks, n = Q/2 = 125,000 of them owned.
Q, N_ = 250_000, 125_000
PACK = Q * (2 + 2) / MEM_BW  # issue_reduce: read g, write r
LAND0 = Q * (2 + 2) / MEM_BW  # _land_full_grads: divided, cast and copied in one pass
LAND1 = 2 * N_ * 2 / MEM_BW  # div_ of the [S] slot; grad_shard: .to(bf16) of bf16, a view
MORE2 = (2 * N_ * 2 + N_ * (2 + 2 * 2)) / MEM_BW  # div_, add_ into grad_shard
UNPACK = 2 * Q * 2 / MEM_BW  # unpack_into the padded storages (stage 3 gather, wait_sync)
SYNC_IN = N_ * (4 + 2) / MEM_BW  # stages 1-2: master.to(bf16), the all-gather input
CAST0 = (Q * (2 + 4) + Q * (4 + 2)) / MEM_BW  # stage 0: grads to fp32, master to weights
CAST12 = N_ * (2 + 4) / MEM_BW  # stages 1-2: the shard's grads to fp32
CAST3 = 2 * N_ * (2 + 4) / MEM_BW  # stage 3: grads to fp32, master into w_shard


def toy(stage, prefetch=1, micro_batches=1, **options):
    return step_time(TOY, ON2, config(stage, prefetch=prefetch, **options), WORK, TOY_CLUSTER,
                     Schedule(1, micro_batches))


PER_UNIT = {"reduce_bucket_size": 0}  # stage 0 reducing unit by unit, as stages 1-3 do


def optimizer(stage):  # 2·(12 + 2) + 2 = 30 bytes streamed per owned parameter
    return 30 * 10**6 / (2 if stage else 1) / MEM_BW


def test_ring_alpha_beta_by_hand():
    link = Link("l", 100e9, 10e-6)
    # all-reduce of 1 GB over 8 ranks: 2·(7·10 µs + 7/8 · 1e9 / 1e11 s) = 17.64 ms
    assert ring_time("all_reduce", 1e9, 8, link) == pytest.approx(17.64 * MS)
    assert ring_time("all_gather", 1e9, 8, link) == pytest.approx(8.82 * MS)
    assert ring_time("reduce_scatter", 1e9, 1, link) == 0.0
    with pytest.raises(ValueError, match="kind='broadcast'"):
        ring_time("broadcast", 1, 2, link)


def test_levels_within_and_across_nodes():
    c = Cluster(Accelerator("a", 1e12, 1e12), get_network("nvlink4-ndr"), gpus_per_node=8)
    assert c.link(8).bandwidth == 450e9
    assert (c.link(9).bandwidth, c.link(9).latency) == (50e9, 10e-6)
    # 7B-style gradients (13.48 GB bf16) reduce-scattered over 64 GPUs across nodes:
    # 63·10 µs + 63/64 · 13.476 GB / 50 GB/s
    t = ring_time("reduce_scatter", 2 * 6_738_149_376, 64, c.link(64))
    assert t == pytest.approx(63 * 10e-6 + 63 / 64 * 2 * 6_738_149_376 / 50e9)


def test_flops_per_token():
    m = ModelSpec("m", 1000, hidden=8, layers=2)
    assert train_flops_per_token(m, 16, False) == 6 * 1000 + 12 * 2 * 8 * 16
    assert train_flops_per_token(m, 16, True) == 8 * 1000 + 16 * 2 * 8 * 16


def test_stage0_hides_all_but_the_last_reduction():
    # one reduction per unit (reduce_bucket_size=0): forward 2 ms, backward 4 ms (+ a
    # pack before each issue), reductions of 0.5 ms behind each unit's backward; at the
    # step three landings run while the last all-reduce is on the wire, then it lands;
    # then the casts around the optimizer
    t = toy(0, **PER_UNIT)
    assert t.compute == pytest.approx(6 * MS)
    assert t.copies == pytest.approx(4 * (PACK + LAND0 + CAST0))
    assert t.step == pytest.approx(6.5 * MS + 4 * PACK + LAND0 + 4 * CAST0 + optimizer(0))
    assert t.exposed == pytest.approx(0.5 * MS - 3 * LAND0)
    assert t.comm == pytest.approx(2 * MS)
    assert t.tokens_per_gpu == pytest.approx(1000 / t.step)


def test_stage0_buckets_a_small_models_units_as_the_engine_does():
    # stage 0's default bucket (DDP's 25 MiB: 13,107,200 bf16 elements) holds all four
    # 250,000-parameter units, so backward's one reduction leaves when the pass ends:
    # 4 packs, one all-reduce of the 2 MB (2 ms), then the 4 landings, all exposed
    t = toy(0)
    assert ZeroConfig(stage=0, mixed_precision=BF16).reduce_bucket == 13_107_200
    assert t.compute == pytest.approx(6 * MS)
    assert t.step == pytest.approx(8 * MS + 4 * (PACK + LAND0 + CAST0) + optimizer(0))
    assert t.exposed == pytest.approx(2 * MS)
    assert t.comm == pytest.approx(2 * MS)  # the same bytes as four, in one
    # a bucket of two units: two reductions of 1 ms, the first behind units 3-4's
    # backward and landed while the second is on the wire
    two = step_time(TOY, ON2, config(0, reduce_bucket_size=500_000), WORK, TOY_CLUSTER)
    assert two.step == pytest.approx(7 * MS + 4 * (PACK + CAST0) + 2 * LAND0 + optimizer(0))
    # a bucket between unit sizes rounds up to whole units (the reducer issues once it
    # holds at least the bucket): 300,000 elements take two units, as 500,000 do
    assert step_time(TOY, ON2, config(0, reduce_bucket_size=300_000), WORK,
                     TOY_CLUSTER).step == pytest.approx(two.step)
    # with a latency every reduction pays it: one bucket pays it once, four units four times
    slow = Cluster(TOY_CLUSTER.accelerator, Network("toy", Link("l", 1e9, 1e-4),
                                                   Link("l", 1e9, 1e-4)))
    per_unit = step_time(TOY, ON2, config(0, reduce_bucket_size=0), WORK, slow)
    bucket = step_time(TOY, ON2, config(0), WORK, slow)
    assert per_unit.comm - bucket.comm == pytest.approx(3 * 2 * 1e-4)


def test_stage1_post_step_gathers_are_exposed():
    # the last reduce-scatter (0.25 ms) leaves after 4 packs and the landing of unit 2
    # (the third in flight lands unit 1's before unit 4's backward); it lands; the casts
    # and the optimizer; then the first all-gather input, four unit all-gathers of
    # 0.25 ms back to back (each unpack hides behind the next gather) and the last unpack
    def step(land):
        return (6.25 * MS + 4 * PACK + 2 * land + 4 * CAST12 + optimizer(1) + SYNC_IN
                + 1 * MS + UNPACK)

    t = toy(1)
    assert t.step == pytest.approx(step(LAND1))
    copies = 4 * (PACK + LAND1 + CAST12 + SYNC_IN + UNPACK)
    assert t.copies == pytest.approx(copies)
    assert t.exposed == pytest.approx(t.step - 6 * MS - optimizer(1) - copies)
    assert toy(2).step == pytest.approx(step(LAND1))  # ZeRO-2's grad_shard: a view too


def test_stage3_prefetch_one_exposes_the_first_gather_of_each_pass():
    # 2·G + 4F + 4B + the last reduce-scatter, + 8 unpacks and 4 packs on the way, the
    # landing of unit 1 before unit 4's gather and the landing of the last
    t = toy(3, prefetch=1)
    copies = 8 * UNPACK + 4 * PACK + 2 * LAND1
    assert t.step == pytest.approx((0.5 + 2 + 4 + 0.25) * MS + copies + 4 * CAST3
                                   + optimizer(3))
    assert t.copies == pytest.approx(4 * (2 * UNPACK + PACK + LAND1 + CAST3))
    assert t.exposed == pytest.approx(0.75 * MS - 2 * LAND1)
    assert toy(3, prefetch=2).step == pytest.approx(t.step)


def test_stage3_without_prefetch_waits_for_every_gather():
    # forward 4·(G + F); in backward each gather queues behind the previous reduction
    # (which hides unit 1's landing); 8 unpacks, 4 packs and the last landing add
    t = toy(3, prefetch=0)
    assert t.step == pytest.approx(9.0 * MS + 8 * UNPACK + 4 * PACK + LAND1 + 4 * CAST3
                                   + optimizer(3))
    assert t.exposed == pytest.approx(3.0 * MS - 3 * LAND1)


def test_three_reductions_in_flight_wait_and_slow_links_serialise():
    slow = Link("slow", 0.25e9, 0.0)  # all-reduce of a unit: 2 ms, longer than a backward
    c = Cluster(TOY_CLUSTER.accelerator, Network("slow", slow, slow))
    t = step_time(TOY, ON2, config(0, **PER_UNIT), WORK, c)
    # only the first pack delays the wire; the last all-reduce lands after the others
    assert t.step == pytest.approx((3 + 4 * 2) * MS + PACK + LAND0 + 4 * CAST0 + optimizer(0))


def test_two_micro_batches_on_a_slow_link():
    # 2 ms all-reduces queue behind a 1 ms backward per unit; the first backward ends
    # when its last reduction lands (11 ms + a pack + a landing: the other landings hide
    # in that wait), the second micro-batch's forward and backward follow (6 ms) and its
    # last reduction lands 5 ms after its first unit's backward: 22 ms in all
    slow = Link("slow", 0.25e9, 0.0)
    c = Cluster(TOY_CLUSTER.accelerator, Network("slow", slow, slow))
    t = step_time(TOY, ON2, config(0, **PER_UNIT), WORK, c, Schedule(micro_batches=2))
    assert t.step == pytest.approx(22 * MS + 2 * PACK + 2 * LAND0 + 4 * CAST0 + optimizer(0))


def test_accumulation_lands_each_backward_before_the_next_forward():
    # each backward ends once its reductions landed (the shards then hold their .grad):
    # the last 0.5 ms all-reduce of every micro-batch is exposed, its landing too, and
    # the others land while it travels
    assert toy(0, micro_batches=2, **PER_UNIT).step == pytest.approx(
        13 * MS + 8 * PACK + 2 * LAND0 + 4 * CAST0 + optimizer(0))
    # beyond three simulated micro-batches the steady-state increment repeats
    assert toy(0, micro_batches=5, **PER_UNIT).step == pytest.approx(
        32.5 * MS + 20 * PACK + 5 * LAND0 + 4 * CAST0 + optimizer(0))
    # ZeRO-2's later micro-batches add into grad_shard: no overlap makes it a plain sum
    c = Cluster(TOY_CLUSTER.accelerator, Network("cpu", TOY_LINK, TOY_LINK, overlap=False))
    t = step_time(TOY, ON2, config(2), WORK, c, Schedule(micro_batches=3))
    copies = 4 * (3 * PACK + LAND1 + 2 * MORE2 + CAST12 + SYNC_IN + UNPACK)
    assert t.copies == pytest.approx(copies)
    # 3 × 6 ms of compute, 3 × 4 reduce-scatters and 4 all-gathers of 0.25 ms
    assert t.step == pytest.approx(18 * MS + 4 * MS + copies + optimizer(2))


def test_without_overlap_every_collective_adds():
    c = Cluster(TOY_CLUSTER.accelerator, Network("cpu", TOY_LINK, TOY_LINK, overlap=False))
    t = step_time(TOY, ON2, config(3), WORK, c)
    # 6 ms of compute, 8 gathers and 4 reduce-scatters of 0.25 ms, every copy
    copies = 4 * (2 * UNPACK + PACK + LAND1 + CAST3)
    assert t.step == pytest.approx(9 * MS + copies + optimizer(3))
    assert t.exposed == pytest.approx(3 * MS)


def test_gloo_reduces_as_all_reduce_or_an_exchange_and_counts_its_copies():
    # one unit of Q = 1,000 over N = 4 (n = 250): on gloo stages 1-3 divide the reduced
    # slot as it leaves the all-reduced buffer (the same bytes as dividing in place) and
    # stage 3 copies its shard into the gather's slot (2·n·w); nothing else changes
    mixed = BF16.with_reduce_dtype("fp32")
    on4, on8 = ParallelDims(4), ParallelDims(8)
    plain = [copy_bytes(config(s, mixed), on4, 1000) for s in range(4)]
    gloo = [copy_bytes(config(s, mixed), on4, 1000, gloo=True) for s in range(4)]
    assert gloo[:3] == plain[:3]
    assert gloo[3].gather - plain[3].gather == 2 * 250 * 2
    assert gloo[3].land == plain[3].land and gloo[3].land_more == plain[3].land_more
    # above GLOO_BROADCAST_MAX ranks torch's all-gather copies its flat output out: 2·Q·w,
    # at stage 3's gathers and at stages 1-2's post-step gathers alike
    wide = [copy_bytes(config(s, mixed), on8, 1000, gloo=True) for s in range(4)]
    narrow = [copy_bytes(config(s, mixed), on8, 1000) for s in range(4)]
    assert wide[3].gather == 2 * (2 * 1000 * 2)
    assert [w.sync_unpack - x.sync_unpack for w, x in zip(wide, narrow)] == [0, 4000, 4000, 0]
    # one rank: torch's collectives, nothing added
    on1 = ParallelDims(1)
    assert all(copy_bytes(config(s, mixed), on1, 1000, gloo=True) == copy_bytes(
        config(s, mixed), on1, 1000) for s in range(4))
    # between two gloo ranks a reduction is an exchange of slots: the received slot is
    # added to this rank's own part before the divide, 3·n·r more (n = 500, r = 4)
    pair = [copy_bytes(config(s, mixed), ON2, 1000, gloo=True).land
            - copy_bytes(config(s, mixed), ON2, 1000).land for s in range(4)]
    assert pair == [0, 6000, 6000, 6000]
    # without overlap every collective adds: at N = 2 stage 3's 4 reductions take a
    # reduce-scatter's 0.25 ms (the exchange sends the ring's bytes), as its 8 gathers do
    c = Cluster(TOY_CLUSTER.accelerator, Network("cpu", TOY_LINK, TOY_LINK, overlap=False,
                                                 gloo=True))
    t = step_time(TOY, ON2, config(3), WORK, c)
    copies = 4 * (2 * UNPACK + PACK + LAND1 + CAST3)
    extra = 4 * 2 * (2 * N_ * 2) / MEM_BW  # per unit: two gathers' inputs into their slot
    added = 4 * 3 * N_ * 2 / MEM_BW  # per unit: the exchange's add
    assert t.copies == pytest.approx(copies + extra + added)
    assert t.step == pytest.approx(9 * MS + copies + extra + added + optimizer(3))
    # at N = 4 each reduction is an all-reduce of the unit's 500 kB: 2·3/4·0.5 ms, twice
    # the reduce-scatter's time, beside 8 gathers of 3/4·0.5 ms
    t4 = step_time(TOY, on4, config(3), WORK, c)
    assert t4.comm == pytest.approx(8 * 0.375 * MS + 4 * 0.75 * MS)


def test_copy_bytes_per_stage_by_hand():
    # one unit of Q = 1,000 parameters over N = 4 ranks (n = 250 owned); bf16 weights and
    # gradients reduced in fp32 (the engine's default under bf16): w = g = 2, r = m = 4
    mixed = BF16.with_reduce_dtype("fp32")
    c = [copy_bytes(config(stage, mixed), ParallelDims(4), 1000) for stage in range(4)]
    assert [x.pack for x in c] == [1000 * (2 + 4)] * 4  # _chunk_cat: read g, write r
    # stage 0: divided, cast to bf16 and copied into the full gradients in one pass
    assert c[0].land == c[0].land_more == 1000 * (4 + 2)
    assert c[1].land == c[1].land_more == 2 * 250 * 4 + 250 * (4 + 2)  # div_ [S], .to(bf16)
    assert c[2].land == c[3].land == 2000 + 250 * (4 + 2)  # div_, grad_shard cast to bf16
    assert c[2].land_more == 2000 + 250 * (4 + 2 * 2)  # div_, add_ into grad_shard
    assert [x.gather for x in c] == [0, 0, 0, 2 * 1000 * 2]  # unpack_into, per gather
    assert [x.sync_input for x in c] == [0, 250 * (4 + 2), 250 * (4 + 2), 0]  # master cast
    assert [x.sync_unpack for x in c] == [0, 4000, 4000, 0]  # wait_sync's unpack_into
    # assign_step_grads' fp32 cast; refresh_compute's master copy at stages 0 and 3
    assert [x.step for x in c] == [6000 + 6000, 1500, 1500, 1500 + 1500]
    assert [x.per_step(1, 1) for x in c] == [24000, 16500, 16500, 20500]
    assert c[2].per_step(3, 2) == 3 * (16500 + 6000 + 4000)  # a second pass: pack, add_
    # fp32 AdamW (no master, nothing to cast, grad_shard a view): 16Q at stage 0; the
    # divide 2·Q·r/N at stages 1-3; 2·Q·w/N for the cat input, and the unpack of the
    # other ranks' rows only, 2·(Q - Q/N)·w
    fp32 = get_recipe("fp32-adamw")
    assert [copy_bytes(config(s, fp32), ParallelDims(4), 1000).per_step(1, 1)
            for s in range(4)] == [
        8000 + 8000, 8000 + 2000 + 2000 + 6000, 8000 + 2000 + 2000 + 6000, 8000 + 2000 + 16000]


def test_copies_run_on_the_compute_stream():
    # unit by unit, memory at 10 GB/s: per unit a pack of 0.1 ms, a stage-0 landing of
    # 0.1 ms, casts of 0.3 ms; the optimizer 3 ms. Each pack delays its all-reduce
    # (issued at 3.1, 4.2, 5.3 and 6.4 ms, arriving 0.5 ms later); from 6.4 ms the step
    # lands them one by one
    # (6.5, 6.6, 6.7), waits for the last to arrive at 6.9 (0.2 ms exposed) and lands it
    # by 7.0 ms; then 1.2 + 3 ms.
    c = Cluster(Accelerator("slow memory", RATE, 1e10, efficiency=1.0), TOY_CLUSTER.network)
    t = step_time(TOY, ON2, config(0, **PER_UNIT), WORK, c)
    assert t.step == pytest.approx(11.2 * MS)
    assert t.copies == pytest.approx(4 * (0.1 + 0.1 + 0.3) * MS)
    assert t.exposed == pytest.approx(0.2 * MS)


def test_schedule_validation_names_the_value():
    """The stage and the prefetch are the engine's ``ZeroConfig``'s to check; the
    schedule checks what it adds."""
    with pytest.raises(ValueError, match="stage=5"):
        config(5)
    with pytest.raises(ValueError, match="prefetch=-1 must be an integer >= 0"):
        config(3, prefetch=-1)
    with pytest.raises(ValueError, match="micro_batches=0 must be an integer >= 1"):
        Schedule(micro_batches=0)
    with pytest.raises(ValueError, match="blocks_per_unit=0 must be an integer >= 1"):
        Schedule(0)
    with pytest.raises(ValueError, match="efficiency=1.5"):
        Accelerator("x", 1e12, 1e12, efficiency=1.5)
    with pytest.raises(ValueError, match="bandwidth=0"):
        Link("x", 0, 0.0)


# -- tensor parallelism in the memory model ---------------------------------------------

M7 = ModelSpec("7B-style", 6_738_149_376, 4096, 32, 32)


def test_tp_divides_state_then_zero_shards_it():
    P = M7.params
    assert model_state_bytes(P, ParallelDims(8, 2), config(0)) == (P, P, 6 * P)
    w, g, o = model_state_bytes(P, ParallelDims(16, 2), config(3))
    assert (w, g, o) == (-(-P // 8), -(-P // 8), -(-6 * P // 8))
    assert model_state_bytes(P, ParallelDims(8, 1), config(2)) == model_state_bytes(
        P, ON8, config(2))
    # DP traffic is the 1/tp of the model over gpus/tp ranks
    assert comm_bytes(P, ParallelDims(16, 2), config(0)) == ring_all_reduce(P, 8)


def test_tp_activations_korthikanti():
    t, tok, h = 2, 2048, 4096
    # checkpointing: layer inputs whole, the recomputed layer (10 + 24/t)/2 elements
    flash = Workload(tok, flash_attention=True)
    assert activation_bytes(M7, BF16, flash, tp=t) == tok * h * (32 * 2 + 22)
    # without flash the recomputed layer keeps its 5·a·s/(h·t) of scores too
    assert activation_bytes(M7, BF16, Workload(tok), tp=t) == tok * h * (32 * 2 + 22) + (
        5 * 32 * tok * tok // t)
    # no checkpointing: per layer s·h·(10 + 24/t + 5·a·s/(h·t)) 16-bit bytes
    full = activation_bytes(M7, BF16, Workload(tok, checkpointing=False), tp=t)
    assert full == 32 * tok * h * (10 + 24 // t + 5 * 32 * tok // (h * t))
    assert activation_bytes(M7, BF16, flash, tp=1) == tok * h * 49 * 2


def test_tp_all_reduces_are_counted():
    work = Workload(2048)
    one = ring_all_reduce(2048 * 4096 * 2, 4)
    assert tp_comm_bytes(M7, BF16, work, 4) == 32 * 6 * one  # 4 per layer + 2 recomputed
    plan = plan_strategy(M7, ParallelDims(32, 4), config(3), Workload(2048, checkpointing=False))
    assert plan.tp_comm == 32 * 4 * one and plan.as_dict()["tp"] == 4
    assert plan_strategy(M7, ON8, config(3)).tp_comm == 0


def test_tp_must_divide_gpus():
    with pytest.raises(ValueError, match=r"tp=3 does not divide the 8 ranks; expected one of "
                                         r"\[1, 2, 4, 8\]"):
        plan_strategy(M7, ParallelDims(8, 3), config(3))


# -- recommend ----------------------------------------------------------------------------

H100 = Cluster(Accelerator("h100", 989e12, 3.35e12), get_network("nvlink4-ndr"))
CASES = [(m, n) for m in ("llama2-7b", "llama2-13b", "llama2-70b") for n in (8, 16, 64, 256)]
KEYS = ("stage", "tp", "shard group", "unit size", "prefetch", "checkpointing", "micro-batch",
        "offload")


def test_7b_on_one_h100_node_by_hand():
    # llama2-7b, 8 GPUs on NVLink 4, one micro-batch of 2,048 tokens with checkpointing:
    # the reductions of 32 units hide behind backward except the last; ZeRO-1 then
    # all-gathers the 32 units' updated weights after the step.
    m = ModelSpec.from_arch(get_preset("llama2-7b"))
    P, Q, bw = m.params, m.params / 32, 3.35e12
    compute = (8 * P + 16 * 32 * 4096 * 2048) * 2048 / (989e12 * 0.4)
    one_way = 7 * 3e-6 + 7 / 8 * (2 * P / 32) / 450e9  # a unit's reduce-scatter/all-gather
    # DDP copies, bf16 (w = g = r = 2, m = 4): a pack 4Q, a landing 4Q (divided and
    # copied in one pass), casts 6Q + 6Q: 20P. The step lands 31 reductions (0.25 ms
    # each) while the last all-reduce (1.7 ms) is on the wire: none exposed.
    ddp = step_time(m, ON8, config(0), Workload(2048), H100)
    assert ddp.step == pytest.approx(compute + 20 * P / bw + 30 * P / bw)
    assert ddp.exposed == pytest.approx(0.0, abs=1e-12)
    # ZeRO-1: 32 packs (4Q); landings of Q/2 (div_ of the [S] slot) as units 3-31 issue
    # a third reduction (unit 32's and the second-last hide behind the last
    # reduce-scatter), then the last; the shard's fp32 gradient casts (6Q/8 per unit);
    # the first master cast (6Q/8), 32 all-gathers back to back (each unpack of 4Q is
    # shorter than a gather), the last unpack
    z1 = step_time(m, ON8, config(1), Workload(2048), H100)
    assert z1.step == pytest.approx(compute + (32 * 4 * Q + 29 * Q / 2) / bw + one_way
                                    + Q / 2 / bw + (32 * 6 * Q / 8) / bw + 30 * P / 8 / bw
                                    + 6 * Q / 8 / bw + 32 * one_way + 4 * Q / bw)
    assert z1.tokens_per_gpu == pytest.approx(2048 / z1.step)


@pytest.mark.parametrize("name,gpus", CASES)
def test_recommend_seed_models(name, gpus):
    model = ModelSpec.from_arch(get_preset(name))
    budget = 80 * 10**9
    rec = recommend(model, config(), gpus, budget, H100, 1024, 2048)
    if name == "llama2-70b" and gpus <= 16:
        # 16P/16 = 69 GB of state, and at the step 4P/16 of fp32 gradient copies and as
        # much of AdamW's sqrt(v): 103 GB, past 72 on the device; with the master and the
        # optimizer state in host memory ZeRO-3 fits, and the reason says at what cost
        assert rec.best.offload == "optimizer" and rec.best.stage == 3
        assert rec.reasons["offload"].startswith("optimizer: nothing fits 72.00 GB on the "
                                                 "device without it")
        assert rec.best.memory <= budget * (1 - HEADROOM)
        device = recommend(model, config(), gpus, budget, H100, 1024, 2048,
                           allow_offload=False)
        assert device.best is None
        assert "its peak fits from 24 GPUs" in device.reasons["none"]
        return
    b = rec.best
    assert set(rec.reasons) == set(KEYS) and all(rec.reasons[k] for k in KEYS)
    assert b.strategy in rec.reasons["stage"] and "headroom" in rec.reasons["stage"]
    # feasible by the planner's own peak: the loss's backward, a unit's, the step
    work = Workload.of_mode(b.micro_batch * 2048, 2048, b.checkpointing)
    planned = peak(model, ParallelDims(gpus, b.tp, b.shard_group),
                   config(b.stage, prefetch=b.prefetch), work, b.blocks_per_unit,
                   b.accumulation)
    assert b.memory == planned.bytes <= budget * (1 - HEADROOM)
    assert gpus // b.tp * b.micro_batch * b.accumulation == 1024
    assert rec.runners_up and all(c.time.step >= b.time.step * 0.99 for c in rec.runners_up)


def test_recommend_70b_on_16_h200s_fits():
    model = ModelSpec.from_arch(get_preset("llama2-70b"))
    rec = recommend(model, config(), 16, 141 * 10**9, H100, 1024, 2048)
    assert rec.best.memory <= 0.9 * 141e9
    device = recommend(model, config(), 8, 141 * 10**9, H100, 1024, 2048, allow_offload=False)
    assert "its peak fits from 16 GPUs" in device.reasons["none"] and device.best is None
    assert recommend(model, config(), 8, 141 * 10**9, H100, 1024, 2048).best.offload == (
        "optimizer")


def test_recommend_headroom_is_a_setting():
    model = ModelSpec.from_arch(get_preset("llama2-70b"))
    # ZeRO-3 on 16 GPUs peaks at 103.5 GB (the step): above 0.9 x 110, within 110
    tight = recommend(model, config(), 16, 110 * 10**9, H100, 1024, 2048,
                      allow_offload=False)
    assert "--headroom sets the share left free" in tight.reasons["none"]
    rec = recommend(model, config(), 16, 110 * 10**9, H100, 1024, 2048, headroom=0.0)
    assert rec.best.stage == 3 and rec.best.memory <= 110 * 10**9
    assert "(0% headroom)" in rec.reasons["stage"] and rec.as_dict()["headroom"] == 0.0
    with pytest.raises(ValueError, match="headroom=1.0 must be a fraction in"):
        recommend(model, config(), 16, 80 * 10**9, H100, 1024, 2048, headroom=1.0)


def test_choose_prefers_the_simpler_configuration_within_one_percent():
    def cand(stage, step, tp=1, ckpt="none"):
        t = StepTime("x", step, 0, 0, 0, 0, 0, 0, 1)
        return Candidate(stage, tp, 1, 1 if stage == 3 else 0, ckpt, 1, 1, 0, t)

    z3, z1, ddp = cand(3, 1.0), cand(1, 1.009), cand(0, 1.02)
    assert choose([z3, z1, ddp]) is z1  # within 1%: the lower stage
    assert choose([z3, ddp]) is z3  # 2% slower: the faster, higher stage
    assert choose([cand(2, 1.0, tp=2), cand(2, 1.005)]).tp == 1
    assert choose([cand(2, 1.0, ckpt="full"), cand(2, 1.02)]).checkpointing == "full"
    # within 1%: the least recompute
    assert choose([cand(2, 1.0, ckpt="full"), cand(2, 1.005, ckpt="selective")]
                  ).checkpointing == "selective"


def test_recommend_cli_text_and_json(capsys):
    assert main(["plan", "--model", "llama2-13b", "--gpus", "64", "--recommend"]) == 0
    text = capsys.readouterr().out
    assert "recommended: llama2-13b on 64 x h100" in text and "runners-up" in text
    assert main(["plan", "--model", "llama2-7b", "--gpus", "16", "--recommend", "--tp", "1",
                 "--network", "pcie4-roce", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommend"]["best"]["tp"] == 1 and out["network"] == "pcie4-roce"
    assert set(out["recommend"]["reasons"]) == set(KEYS)


def test_time_cli(capsys):
    assert main(["plan", "--model", "llama2-7b", "--time", "--global-batch", "64",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [t["strategy"] for t in out["time"]] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    assert all(t["step"] > t["compute"] > 0 for t in out["time"])
    assert main(["plan", "--model", "llama2-7b", "--gpus", "16", "--tp", "2", "--time"]) == 0
    text = capsys.readouterr().out
    assert "TP = 2 (ZeRO over 8 ranks)" in text and "exposed s" in text


BAD = [
    (["--network", "wifi"], "unknown network 'wifi'; expected one of nvlink4-ndr"),
    (["--accelerator", "tpu", "--time"], "unknown accelerator 'tpu'"),
    (["--tp", "3"], "--tp=3 does not divide --gpus=8; expected one of [1, 2, 4, 8]"),
    (["--tp", "0"], "--tp=0 must be positive"),
    (["--efficiency", "1.5", "--time"], "--efficiency=1.5 must be in (0, 1]"),
    (["--headroom", "1.5", "--recommend"], "--headroom=1.5 must be a fraction in [0, 1)"),
    (["--prefetch", "-1", "--time"], "--prefetch=-1 must be 0 or more"),
    (["--time", "--recommend"], "--time and --recommend contradict each other"),
    (["--time", "--global-batch", "12"], "--global-batch=12 sequences of 2048 tokens do not"),
    (["--recommend", "--tp", "1", "--global-batch", "12"], "does not divide over 8 data-"),
    (["--params", "100", "--recommend"], "--recommend needs the model's shape"),
    (["--tp", "2", "--min-gpus"], "drop --tp=2"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_values_are_one_line(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_recommend_never_imports_torch():
    code = ("import sys, zeroshard.commands.plan_time, zeroshard.cli as c; "
            "c.main(['plan', '--recommend', '--json']);"
            "c.main(['plan', '--time']); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_recommend_weighs_each_checkpointing_mode():
    """Llama-2-13B on 256 H100s over PCIe and RoCE: selective checkpointing (the linear
    layers' outputs kept, attention's core recomputed) fits 4 sequences and beats full
    checkpointing's extra forward; named, the mode is kept fixed."""
    m13 = ModelSpec.from_arch(get_preset("llama2-13b"))
    roce = Cluster(H100.accelerator, get_network("pcie4-roce"))
    rec = recommend(m13, config(), 256, 80 * 10**9, roce, 1024, 2048)
    b = rec.best
    assert (b.checkpointing, b.micro_batch) == ("selective", 4)
    why = rec.reasons["checkpointing"]
    assert why.startswith("selective: the linear layers' outputs kept")
    full = recommend(m13, config(), 256, 80 * 10**9, roce, 1024, 2048, checkpointing="full")
    assert full.best.checkpointing == "full" and full.best.time.step > b.time.step
    same = [c for c in rec.runners_up + (b,) if c.checkpointing == "full"
            and (c.stage, c.tp, c.shard_group) == (b.stage, b.tp, b.shard_group)]
    assert "full +" in why and "none does not fit even one sequence" in why
    assert all(c.time.step > b.time.step for c in same)
    assert {c.checkpointing for c in rec.runners_up} >= {"selective", "full"}
    with pytest.raises(ValueError, match="checkpointing='full\\+offload': the search weighs "
                                         "none, selective, full"):
        recommend(m13, config(), 256, 80 * 10**9, roce, 1024, 2048,
                  checkpointing="full+offload")


def test_plan_takes_the_engines_checkpointing_modes(capsys):
    """``--activation-checkpointing MODE``: the table's title names it, and the activations
    fall as the mode keeps less (offload: none of the inputs on the device)."""
    activ = {}
    for mode in ("none", "selective", "2", "full", "full+offload"):
        assert main(["plan", "--model", "llama2-7b", "--gpus", "8", "--json",
                     "--activation-checkpointing", mode]) == 0
        out = json.loads(capsys.readouterr().out)
        activ[mode] = out["strategies"][0]["activations"]
    assert activ["none"] > activ["2"] > activ["selective"] > activ["full"] > activ[
        "full+offload"] > 0
    assert main(["plan", "--model", "llama2-7b", "--activation-checkpointing", "2"]) == 0
    assert "checkpointing every 2nd block" in " ".join(capsys.readouterr().out.split())
    assert main(["plan", "--model", "llama2-7b", "--no-checkpointing", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["strategies"][0]["activations"] == activ["none"]
