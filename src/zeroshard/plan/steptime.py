"""The step-time model: compute, communication, copies, and what the engine hides (the
equations and their validation: docs/steptime.md).

**Compute.** Per token, forward
``2·P + 4·L·h·s`` FLOPs (a multiply-add per weight; the attention scores and weighted
sum over ``s`` positions), backward twice that: ``6·P + 12·L·h·s`` (Kaplan et al., 2020,
table 1; Narayanan et al., 2021, section 5.1); checkpointing recomputes the forward of
every k-th block (``checkpoint_every``), a share 1/k of ``2·P + 4·L·h·s``; selective
checkpointing attention's ``4·L·h·s`` alone. TP of degree K gives each GPU 1/K. Model
FLOPs and recompute are charged apart: time = (model FLOPs + ``recompute_charge`` ×
recomputed FLOPs) / (peak × efficiency), both calibrated per accelerator on published
runs (``plan/published.py``; docs/steptime.md).

**Communication** (ring alpha-beta model; Thakur, Rabenseifner and Gropp, 2005;
Patarasuk and Yuan, 2009): over n ranks a reduce-scatter or all-gather of T bytes takes
``(n-1)·α + (n-1)/n·T/β``, an all-reduce twice that, on the slowest network level the
ring spans (:meth:`Cluster.link`).

**Overlap, as zeroshard's engine schedules it** (``runtime/schedule.py``,
``runtime/model.py``): one serial link carries the data-parallel collectives in issue
order; the compute stream waits on them only where the engine waits:

- every stage reduces each unit's gradients once its backward is done, in reverse
  forward order — stages 1–3 with at most two in flight (a third waits for the oldest),
  stage 0 without a bound — hidden behind the backward of the units still to come;
  a reduction carries as many units as fill ``ZeroConfig.reduce_bucket`` elements (stage
  0's default: torch DDP's 25 MiB, so a small model's units share a few reductions;
  stages 1–3: one unit each), the units left at the end of the pass in one more;
  each backward ends once all of them have landed (every shard then holds its
  gradient, as in FSDP2): the last is exposed, and with accumulation the next
  micro-batch's forward starts after it;
- stage 3 gathers each unit before its forward and again before its backward, and the
  next ``prefetch`` units' as soon as its own has landed: the first gather of each pass
  is exposed, and with ``prefetch`` 0 every gather is;
- stages 1–2 all-gather the updated weights after the step, unit by unit, two in
  flight; the step's hook waits for all but the last, the next forward for that one:
  exposed;
- the optimizer streams its shard's ``2·(optimizer + weights) + grads`` bytes per
  owned parameter once at the memory rate;
- disk offload (the policy places the optimizer on disk): the host step streams the master and the
  moments through sub-groups while two threads read the next and write the last,
  ``(m + S)`` bytes an owned element each way at the host's ``disk_bandwidth``;
  the step takes ``offload.streamed_step``'s seconds (each sub-group the slower of its
  host step and the I/O beside it, one read before and one write after), and
  ``StepTime.disk_wait`` is what that adds to the host step;
- TP's activation all-reduces sit between a layer's matrix multiplies: never hidden;
- the engine's own copies (:class:`CopyBytes`: packing, averaging, unpacking, casts) run
  at the memory rate on the compute stream where the engine makes them (it has no copy
  streams).

**Hybrid sharding** (``ParallelDims.shard`` K): the stage's gathers and reductions run
over the K ranks of a shard group, on the link of its K·tp consecutive GPUs (NVLink when
K·tp is a node or less); each reduction, once waited, is followed by the all-reduce of
the reduced slot (stage 0: the whole buffer) over the R = dp / K replicas, on the link
of R GPUs K·tp apart (the inter-node link when the group fills a node). The engine
issues that all-reduce when it waits for the reduction, and waits for it at once
(``runtime/collectives.py``, ``_across``): it is on the compute stream, never hidden,
and the two levels are separate channels.

**Offload** (``ZeroConfig.offload``; ``plan/placement.py``): every landing copies the reduced
slot down to the host in the master dtype, and with ``params`` every gather first copies
the rank's shard up, on the compute stream where the engine makes them (``Tensor.to``
with ``non_blocking``: ordered on the stream, never hidden), at the host link's rate
(:class:`~zeroshard.plan.hardware.Host`); the optimizer step runs on the host at the
node's host memory bandwidth shared by its GPUs, then the updated shard goes up (stages
1-2 as each all-gather's input, stage 3 into the device shard; with ``params`` it stays
on the host). ``StepTime.pcie`` is those copies' seconds.

**ZeRO++** (``ZeroConfig``'s hpZ, qwZ and qgZ; ``plan/comm.py``): with hpZ each backward gather runs
over the K2 ranks of a secondary group, on the link of K2·tp consecutive GPUs (NVLink
when they share a node), its K slots' ``K·n·w`` bytes; qwZ's gathers and qgZ's
reduction carry ``K·quantized_nbytes(n)`` bytes instead (qgZ an all-to-all: the ring
reduce-scatter's time), and their quantize and dequantize passes are copies on the
compute stream (:class:`CopyBytes`). The collectives share the one serial link.

On a network marked ``overlap=False`` (gloo on a CPU, whose transfers take the cores
that compute) nothing hides: compute + TP + optimizer + copies + every collective.

Units are the L layers grouped ``blocks_per_unit`` at a time, P/U parameters each (the
embeddings and head spread over them). A step of A micro-batches is simulated for
min(A, 3) and the last micro-batch's increment repeated (steady state).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.config import ZeroConfig
from ..spec.dims import ParallelDims
from ..spec.formulas import ceil_div
from .arch import ModelSpec
from .copies import CopyBytes, copy_bytes  # noqa: F401 - re-exported
from .hardware import Cluster, Link
from .layout import check_layout, secondary
from .memory import STRATEGIES
from .placement import disk_seconds, host_step_bytes, master_bytes
from .simulate import _land, _Link, _pass, _sync, units_per_reduction
from .tp import tp_layer_collectives, tp_params, tp_root_bytes
from .workload import Workload

#: Micro-batches simulated before the steady-state increment is repeated.
SIMULATED = 3


def ring_time(kind: str, nbytes: float, ranks: int, link: Link) -> float:
    """Seconds of a ring collective of ``nbytes`` over ``ranks`` (kind: ``all_reduce``,
    ``reduce_scatter`` or ``all_gather``)."""
    if kind not in ("all_reduce", "reduce_scatter", "all_gather"):
        raise ValueError(f"kind={kind!r}; expected all_reduce, reduce_scatter or all_gather")
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    one_way = (ranks - 1) * link.latency + (ranks - 1) / ranks * nbytes / link.bandwidth
    return 2 * one_way if kind == "all_reduce" else one_way


def train_flops_per_token(model: ModelSpec, seq_len: int, checkpointing: bool) -> float:
    """FLOPs per token of forward + backward (+ the recomputed forward)."""
    attention = 4 * model.layers * model.hidden * seq_len
    forward = 2 * model.params + attention
    return forward * (4 if checkpointing else 3)


def recomputed_share(model: ModelSpec, seq_len: int, work) -> float:
    """The share of a forward's FLOPs that checkpointing runs again in backward: every
    k-th block's whole forward (full), or of every block only attention's core, the
    ``4·L·h·s`` of scores and weighted sums (selective: the linear layers' outputs are
    kept, and what else it recomputes, norms and elementwise operations, is few FLOPs;
    Korthikanti et al., 2022, section 5)."""
    if work.mode == "selective":
        attention = 4 * model.layers * model.hidden * seq_len
        return attention / (2 * model.params + attention)
    return recomputed_blocks(work)


def recomputed_blocks(work) -> float:
    """The share of blocks whose whole forward runs again: 1/k with checkpointing of
    every k-th block, 0 without or with selective checkpointing."""
    if not work.checkpointing or work.mode == "selective":
        return 0.0
    return 1 / work.checkpoint_every


@dataclass(frozen=True)
class Schedule:
    """How one optimizer step runs beyond what ``ZeroConfig`` says: the unit size the
    planner assumes and the accumulation."""

    blocks_per_unit: int = 1
    """Transformer blocks per unit (one all-gather and one reduction each)."""
    micro_batches: int = 1
    """Forward/backward passes per optimizer step (gradient accumulation steps)."""

    def __post_init__(self) -> None:
        for name in ("blocks_per_unit", "micro_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step and where they go."""

    strategy: str
    """DDP, ZeRO-1, ZeRO-2 or ZeRO-3."""
    step: float
    """Seconds per optimizer step."""
    compute: float
    """Seconds of forward and backward compute (recompute included), all micro-batches."""
    tp_comm: float
    """Seconds of TP's activation all-reduces (on the compute path, never hidden)."""
    optimizer: float
    """Seconds of the optimizer step on this GPU's shard."""
    copies: float
    """Seconds of the engine's own copies (:class:`CopyBytes`) at the memory rate, on the
    compute stream."""
    comm: float
    """Seconds the data-parallel collectives occupy the link."""
    exposed: float
    """Seconds the compute stream waits for data-parallel communication (step less
    compute, TP, optimizer and copies)."""
    tokens_per_gpu: float
    """Tokens per second per GPU (global tokens per step / step / GPUs)."""
    across: float = 0.0
    """Of ``comm``, seconds of the replicas' all-reduces across shard groups (hybrid
    sharding; on the compute path: the engine waits for each as it lands a reduction)."""
    pcie: float = 0.0
    """Offload: seconds of copies between the device and the host on the compute stream
    (gradients down, weights up); ``optimizer`` is then the host step."""
    secondary: float = 0.0
    """Of ``comm``, seconds of hpZ's backward gathers inside the secondary groups."""
    disk: float = 0.0
    """Disk offload: seconds the drive reads and writes in a step (the master and the
    moments, each way), mostly beside the host step."""
    disk_wait: float = 0.0
    """Disk offload: seconds the streamed step adds to ``optimizer`` (the first read, the
    last write, and each sub-group whose I/O outlasts its host step)."""

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("strategy", "step", "compute", "tp_comm",
                                              "optimizer", "copies", "comm", "exposed",
                                              "tokens_per_gpu", "across", "pcie",
                                              "secondary", "disk", "disk_wait")}


def step_time(model: ModelSpec, dims: ParallelDims, config: ZeroConfig, work: Workload,
              cluster: Cluster, schedule: Schedule = Schedule()) -> StepTime:
    """Predicted step time of ``config`` on the layout ``dims`` of ``cluster``'s GPUs,
    each running micro-batches of ``work.tokens`` tokens (sequences of
    ``work.seq_len``), units and accumulation as ``schedule`` says."""
    if model.hidden is None or model.layers is None:
        raise ValueError("the step-time model needs the model's shape: give --hidden and "
                         "--layers (or a preset)")
    check_layout(dims, config)
    policy, recipe = config.policy, config.recipe
    tp, dp, replicas = dims.tp, dims.shard_size, dims.replicas  # dp: the stage's K ranks
    acc = cluster.accelerator
    bw = acc.memory_bandwidth
    rate = acc.peak_flops * acc.efficiency
    units = ceil_div(model.layers, schedule.blocks_per_unit)
    layers_per_unit = model.layers / units
    seq = work.seq_len or work.tokens
    fwd = train_flops_per_token(model, seq, False) / 3 * work.tokens / tp / rate
    # TP (plan/tp.py), on the intra-node link of its tp GPUs: r all-reduces per layer in
    # forward, c in backward, r more for a recompute; the root's beside the passes
    r, c = tp_layer_collectives(model)
    b_act = recipe.activation_bytes
    tp_ar = ring_time("all_reduce", work.tokens * model.hidden * b_act, tp, cluster.link(tp))
    tp_root = 0.0 if tp_root_bytes(model, b_act, work.tokens, tp) == 0 else (
        2 * tp_ar + ring_time("all_gather", work.tokens * model.arch.vocab * b_act, tp,
                              cluster.link(tp)))
    f_unit = fwd / units + r * layers_per_unit * tp_ar
    # the recomputed share of a forward, charged at recompute_charge; a recomputed
    # block's TP all-reduces again (selective keeps the outputs they follow)
    recompute = recomputed_share(model, seq, work) * acc.recompute_charge
    ckpt = recomputed_blocks(work)
    b_unit = (2 + recompute) * fwd / units + (c + r * ckpt) * layers_per_unit * tp_ar

    link = cluster.link(dp * tp)  # the shard group's K·tp consecutive GPUs
    local_params = tp_params(model, tp)  # what the plan splits, and the rest whole
    unit_params = local_params / units
    gloo = cluster.network.gloo
    off = policy.offloads_optimizer
    params_on_host = policy.where("params") == "host"
    k2 = secondary(dims, config)
    cost = copy_bytes(config, dims, unit_params, gloo)  # memory rate, on compute
    # qwZ, qgZ: K slots of int8 and one fp32 scale per block (a unit's slot n = Q/K)
    quantized = dp * (unit_params / dp + 4 * ceil_div(unit_params / dp, config.quant_block))
    # offload: a unit's owned slot over the host link (plan/placement.py), per copy
    pcie_bw = cluster.host_side.pcie.bandwidth
    down = unit_params / dp * master_bytes(recipe, True) / pcie_bw if off else 0.0
    shard_up = unit_params / dp * recipe.weight_bytes / pcie_bw if off else 0.0
    upload = shard_up if params_on_host else 0.0  # before every gather
    back = shard_up if off and not params_on_host else 0.0  # after the host step
    gather = ring_time("all_gather", quantized if config.quantize_weights else
                       unit_params * recipe.weight_bytes, dp, link)
    # hpZ: the backward's over the K2 ranks of a secondary group, unquantized
    gather_back = gather if k2 is None else ring_time(
        "all_gather", unit_params * recipe.weight_bytes, k2, cluster.link(k2 * tp))
    scatters = policy.reduce == "reduce_scatter"
    # one reduction of n units' gradients (a bucket: ZeroConfig.reduce_bucket elements)
    if config.quantize_grads:  # an all-to-all on every backend
        def reduce(n: int) -> float:
            return ring_time("reduce_scatter", n * quantized, dp, link)
    else:  # on gloo the engine all-reduces, except between two ranks (an exchange)
        def reduce(n: int) -> float:
            kind = "reduce_scatter" if scatters and (not gloo or dp == 2) else "all_reduce"
            return ring_time(kind, n * unit_params * recipe.reduce_bytes, dp, link)
    every = units_per_reduction(config.reduce_bucket, unit_params, units)
    # a step's reductions: full buckets of ``every`` units, and the rest in one
    reductions = units // every * reduce(every) + (reduce(units % every) if units % every else 0)
    # hybrid sharding: the reduced slot (stage 0: the whole buffer) over the R replicas
    across = ring_time("all_reduce", unit_params * recipe.reduce_bytes / (dp if scatters else 1),
                       replicas, cluster.link(replicas, stride=dp * tp))
    g = gather if policy.shards_params else None
    g_back = gather_back if policy.shards_params else None
    pf = config.prefetch

    # Reducer._flush (runtime/schedule.py): two reductions in flight at most,
    # except at stage 0 when it reduces in the gradients' own dtype
    bounded = policy.bounds_reductions(recipe.grad_bytes, recipe.reduce_bytes)
    line = _Link()
    t, flying, ends = 0.0, [], []
    unpack, unpack_back, pack = cost.gather / bw, cost.gather_back / bw, cost.pack / bw
    for i in range(min(schedule.micro_batches, SIMULATED)):
        t = _pass(t, line, units, f_unit, g, pf, None, [], unpack=unpack, upload=upload)
        t = _pass(t, line, units, b_unit, g_back, pf, reduce, flying, bounded, unpack_back, pack,
                  (cost.land if i == 0 else cost.land_more) / bw + across + down, upload,
                  every)
        t = _land(t, flying)  # a backward ends once its reductions landed: shards hold .grad
        ends.append(t)
    extra = schedule.micro_batches - len(ends)
    shift = extra * (ends[-1] - ends[-2]) if extra > 0 else 0.0
    t += shift

    t += schedule.micro_batches * tp_root  # the embedding's and the head's
    owned_params = local_params / (dp if policy.shards_optimizer else 1)
    disk = disk_wait = 0.0
    if off:  # the host step, the node's host memory shared by its GPUs
        per_element = host_step_bytes(recipe) / cluster.host_bandwidth()
        optimizer = owned_params * per_element
        if policy.optimizer_on_disk:  # master and moments through the drive, each way
            disk, disk_wait = disk_seconds(model.params, dims, config, per_element,
                                           cluster.host_side.disk_bandwidth)
    else:
        streamed = 2 * (recipe.optimizer_bytes + recipe.weight_bytes) + recipe.grad_bytes
        optimizer = owned_params * streamed / bw
    # gradient casts before, master casts after
    t += optimizer + disk_wait + units * cost.step / bw
    post = units * gather if policy.gathers_after_step else 0.0
    if policy.gathers_after_step:  # offloaded, each all-gather's input comes up from the host
        t = _sync(t, line, units, gather, cost.sync_input / bw + back, cost.sync_unpack / bw)
    else:
        t += units * back  # the updated shards up into the device's weight shards
    a = schedule.micro_batches
    compute = a * (1 + 2 + recompute) * fwd
    tp_comm = a * (model.layers * (r + c + r * ckpt) * tp_ar + tp_root)
    copies = cost.per_step(units, a) / bw
    gathers = units * (gather + gather_back) if policy.shards_params else 0.0
    comm = a * (gathers + reductions + units * across) + post
    pcie = units * (a * (down + 2 * upload) + back)
    if not cluster.network.overlap:
        t = compute + tp_comm + optimizer + disk_wait + copies + comm + pcie
    return StepTime(STRATEGIES[config.stage], t, compute, tp_comm, optimizer, copies, comm,
                    max(0.0, t - compute - tp_comm - optimizer - disk_wait - copies - pcie),
                    work.tokens * a / tp / t, a * units * across, pcie,
                    a * units * gather_back if k2 is not None else 0.0, disk, disk_wait)


def step_times(model: ModelSpec, dims: ParallelDims, config: ZeroConfig, work: Workload,
               cluster: Cluster, schedule: Schedule = Schedule()) -> list[StepTime]:
    """One :class:`StepTime` per strategy, DDP first, each at the most of ``config``'s
    options its stage takes (``ZeroConfig.at_stage``)."""
    return [step_time(model, dims, config.at_stage(s), work, cluster, schedule)
            for s in range(len(STRATEGIES))]
