"""What each GPU holds of the training state: bytes per category and where each lives
(device, host or disk), what crosses PCIe, and the optimizer's state where it depends
on the parameters' shapes. One module answers for a unit's placement, as one
module of the engine (``runtime/unit.py``) allocates it; the layout is checked once,
by the public functions, and the helpers below them take it as checked.

# The state

The training state's bytes per GPU by category, wherever it lives.

Stage k shards the first k of (optimizer state, gradients, weights) over the K ranks of
a shard group (ZeRO paper, section 5; ``ShardPolicy``), after tensor parallelism of
degree tp divides all three. With the 2/2/12 recipe over N = K ranks:

    DDP     16P            ZeRO-2  2P + 14P/N
    ZeRO-1  4P + 12P/N     ZeRO-3  16P/N

Offloaded (``ZeroConfig.offload``), the optimizer category holds a master even when
the recipe has none: the engine steps an fp32 host copy beside the device's fp32
weights (4 + 8 bytes an element for fp32 AdamW). Where each category lives is
``offload.placed_bytes``'s question; the sums here are what the engine's ledger counts
per category over every placement.

Every figure is an integer number of bytes; sharded figures round up (a rank holds
whole elements).

# Offload

Offload in the planner: where each byte lives (device or host), what crosses PCIe.

The engine's ``zs.shard(..., offload="optimizer")`` (stages 1-3) keeps the fp32 master
and the optimizer state in host memory (pinned under CUDA), with a host master even when
the recipe has none (fp32: the compute weights stay on the device, the step updates a
host copy). ``offload="params"`` (stage 3) keeps the weight shards there too. Bytes per
GPU at the optimizer step, n = P / (tp·K) owned elements (K the ranks the stage shards
over), w, g, m the compute, gradient and master bytes (m = 4 when offloaded without a
master in the recipe), S the optimizer states' bytes per element:

| category | without offload (device) | ``optimizer`` | ``params`` (stage 3) |
|---|---|---|---|
| weights | the stage's | device, the stage's | host, ``w·n`` |
| grads | the stage's | device, the stage's | device |
| optimizer | the recipe's | host, ``(m + S)·n`` | host |
| buffers | see below | see below | see below |

``buffers`` are stage 1's reduced slot ``g·n``, always on the device, and the fp32 copy
of the owned gradients ``m·n`` for the step: on the device when g ≠ m without offload,
on the host always when offloaded (``runtime/unit.py``: ``memory`` and
``host_bytes``; the engine's ``grad_shard``, ``step_grads`` and ``host_grads``). A
node's host memory must hold its GPUs' host bytes: ``host × gpus_per_node``.

**PCIe per step** (per GPU, one direction each; ``runtime/unit.py``): every synchronised
backward copies each reduced slot to the host as it lands, in the master dtype (cast on
the device first: CUDA converts before it copies across), ``A·m·n`` down for A
micro-batches; after the host step the updated shard goes back cast to the compute dtype
on the host first, ``w·n`` up (stages 1-2 as the all-gather's input, stage 3 into the
device's weight shard). With ``params`` every gather first copies the rank's shard up,
two gathers per micro-batch, ``2·A·w·n``, and the step's cast stays on the host.

**The host step** streams, per owned element, the master and the moments read and
written and the fp32 gradient read, and writes the cast compute copy when its dtype
differs: ``2·(m + S) + m + [w ≠ m]·w`` bytes, 28 in fp32 and 30 under bf16 AdamW
(docs/offload.md: torch's fused CPU AdamW, bandwidth-bound).

**Disk offload** (the policy places the optimizer on ``"disk"``: ``offload_dir`` a
folder, or ``PLANNED_DISK`` for a plan, as ``--offload-dir`` gives it;
``runtime/offload.py``): the master and the states move from the host to files,
``(m + S)·n`` per GPU on disk; the host keeps the fp32 gradient copy and the step's
sub-group buffers, two of ``(m + S)·G`` bytes for sub-groups of G = ``sub_group_size``
elements (fewer when the rank's n elements make fewer sub-groups, and ``min(G, n)``
each). Every step reads and writes the whole partition: ``(m + S)·n`` bytes each way
per GPU, at the host preset's ``disk_bandwidth`` (``plan/hardware.py``). The device's
bytes are host offload's.

**The streamed step's seconds** (:func:`streamed_step`; ``runtime/offload.py``): sub-group
k is stepped while the one I/O thread writes k - 1 back and then reads k + 1 into the
same buffer, in order, as the drive serves them anyway. With sub-groups of g_1 … g_K
elements (G each, the last the rest), a host step of h seconds an element and
d = (m + S)/disk_bandwidth seconds an element each way::

    T = d·g_1 + Σ_k max(h·g_k, d·(g_{k+1} + g_{k-1})) + d·g_K

(terms past either end are 0): the first read before anything steps, each sub-group as
long as the slower of its step and the I/O beside it, the last write after the last
step. Disk-bound (d·2G > h·G, as on every preset: 24 bytes of I/O an element at 5 GB/s
against 30 bytes of host memory at 57.5 GB/s) T is about ``2·d·n`` plus the ends' one
read and one write, h·n when the host step is the slower.

# Optimizers whose state depends on shapes

The optimizer in the planner, where its bytes depend on the parameters' shapes
(``zeroshard plan --optimizer``; [Note: optimizer needs] in ``spec/optimizers.py``).

AdamW keeps two states an element wherever the element is; Muon and Adafactor do not:

- **Muon** (with AdamW for the rest, torch's documented use): one fp32 momentum per
  element of every 2-D parameter, AdamW's two for the others. Row-sharded like Adam's,
  so at K ranks a rank keeps its rows' share. Each step the owner of each matrix
  receives the other ranks' rows of the update (``owner_gather``, in the master dtype)
  and sends them their rows of the orthogonalised result (``owner_scatter``, bf16):
  :func:`owner_comm`, the bytes ``spec.optimizers.owner_bytes`` gives each rank for the
  owners ``assign_owners`` picks, the same as the engine's ledger.
- **Adafactor**: a matrix of R x C keeps a row statistic (R) and a column statistic
  (C); a vector one per element. The row statistic and a vector's are row-sharded; a
  matrix's column statistic spans every row, so each rank keeps it whole. Every step
  all-reduces, over the shard group, each parameter's sums of squares (the weight's and,
  in a second round, the update's) and a matrix's C + 1 column and row sums, fp64:
  :func:`reduction_comm`.

Memory is counted for rank 0 of the shard group (dim-0 chunks of c = ceil(d0/K) rows:
rank 0 holds the most), as :func:`model_state_bytes` does.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.config import ZeroConfig
from ..spec.dims import ParallelDims
from ..spec.formulas import SUB_GROUP_SIZE, ceil_div, dim0_rows  # noqa: F401 (re-exported)
from ..spec.optimizers import OPTIMIZERS, state_elements
from ..spec.policy import ShardPolicy
from ..spec.recipes import DTYPE_BYTES, Recipe
from ..spec.rules import OFFLOADS  # noqa: F401 (re-exported)
from .arch import ModelSpec
from .layout import check_layout
from .shapes import arch_shapes

#: The master's bytes when the recipe has none: the engine keeps an fp32 host copy.
HOST_MASTER_BYTES = DTYPE_BYTES["fp32"]


def master_bytes(recipe: Recipe, offloaded: bool) -> int:
    """Bytes per element of the master: the recipe's, or 4 offloaded without one."""
    m = recipe.master_bytes
    return m or (HOST_MASTER_BYTES if offloaded else 0)


def optimizer_bytes(config: ZeroConfig) -> int:
    """Bytes per element of the optimizer category: the master and the optimizer
    states, with the host master offload adds when the recipe has none."""
    recipe = config.recipe
    offloaded = config.policy.offloads_optimizer
    return master_bytes(recipe, offloaded) + recipe.optimizer_bytes - recipe.master_bytes


def owned(params: int, dims: ParallelDims, policy: ShardPolicy) -> int:
    """Elements whose optimizer state this GPU holds: P/tp when nothing is sharded,
    over K above."""
    k = dims.shard_size if policy.shards_optimizer else 1
    return ceil_div(ceil_div(params, dims.tp), k)


def model_state_bytes(params: int, dims: ParallelDims, config: ZeroConfig,
                      trainable: int | None = None,
                      shapes: list[tuple[int, ...]] | None = None) -> tuple[int, int, int]:
    """(weights, grads, optimizer) bytes per GPU, every placement together (the engine's
    ledger categories): ``config``'s stage shards the first k of (optimizer, grads,
    weights) over the layout's K ranks, after TP divides all by tp; the optimizer's
    bytes are :func:`optimizer_bytes` (a host master offloaded), or, for an optimizer
    whose state depends on the shapes (``Recipe.shaped_state``: Muon, Adafactor), the
    master's plus the state counted from ``shapes``.
    ``trainable``: of the ``params``, those that train (LoRA's adapters), which alone
    have gradients and optimizer state; frozen ones are weights only, at the weights'
    dtype."""
    check_layout(dims, config)
    return _state_bytes(params, dims, config, trainable, shapes)


def _state_bytes(params: int, dims: ParallelDims, config: ZeroConfig, trainable: int | None,
                 shapes: list[tuple[int, ...]] | None) -> tuple[int, int, int]:
    """:func:`model_state_bytes` on a checked layout."""
    policy, recipe = config.policy, config.recipe
    trained = params if trainable is None else trainable

    def part(bytes_per_param: int, count: int, sharded: bool) -> int:
        total = ceil_div(bytes_per_param * count, dims.tp)
        return ceil_div(total, dims.shard_size) if sharded else total

    if recipe.shaped_state:
        if shapes is None:
            raise ValueError(f"optimizer {recipe.optimizer!r} keeps state that depends on "
                             "each parameter's shape: plan a preset (--model), a "
                             "config.json (--hf-config) or a module, not a bare count")
        if trainable is not None:
            raise ValueError(f"optimizer {recipe.optimizer!r} with LoRA adapters: the "
                             "planner knows the base model's shapes, not the adapters'; "
                             "plan --lora with --optimizer adamw")
        m = master_bytes(recipe, policy.offloads_optimizer)
        optimizer = part(m, params, policy.shards_optimizer) + _shaped_state(shapes, dims,
                                                                             config)
    else:
        optimizer = part(optimizer_bytes(config), trained, policy.shards_optimizer)
    return (part(recipe.weight_bytes, params, policy.shards_params),
            part(recipe.grad_bytes, trained, policy.shards_grads), optimizer)


def model_shapes(model: ModelSpec) -> list[tuple[int, ...]] | None:
    """The parameters' shapes of ``model``: its own, its architecture's, or None for a
    bare parameter count."""
    if model.shapes is not None:
        return list(model.shapes)
    return arch_shapes(model.arch) if model.arch is not None else None


def check_shaped(dims: ParallelDims, config: ZeroConfig) -> None:
    """An optimizer whose state depends on the shapes counts each parameter's rows: not
    beside tensor parallelism, which splits them further."""
    if dims.tp > 1:
        raise ValueError(f"--optimizer {config.recipe.optimizer} counts each parameter's "
                         f"rows, and tensor parallelism (tp={dims.tp}) splits them further; "
                         "plan it with tp=1, or with --optimizer adamw")


def _rows(shape: tuple[int, ...], dims: ParallelDims, config: ZeroConfig,
          rank: int = 0) -> int:
    """The dim-0 rows of a parameter ``rank`` keeps the optimizer state of."""
    rows = shape[0] if shape else 1
    if not config.policy.shards_optimizer:
        return rows
    a, b = dim0_rows(rows, rank, dims.shard_size)
    return b - a


def _shaped_state(shapes: list[tuple[int, ...]], dims: ParallelDims, config: ZeroConfig,
                  rank: int = 0) -> int:
    """Bytes of optimizer state (the master left out) one rank keeps for ``shapes``
    under ``config.recipe.optimizer``."""
    check_shaped(dims, config)
    opt = OPTIMIZERS[config.recipe.optimizer]
    item = DTYPE_BYTES[config.recipe.state_dtype]
    return item * sum(state_elements(opt, s, _rows(s, dims, config, rank)) for s in shapes)


@dataclass(frozen=True)
class Bytes:
    """Bytes per GPU at one placement, by the engine's ledger categories."""

    weights: int = 0
    """Compute weights (the ledger's ``params``)."""
    grads: int = 0
    """Stored gradients."""
    optimizer: int = 0
    """Master and optimizer state."""
    buffers: int = 0
    """The step's gradient buffers: stage 1's reduced slot, the fp32 copies."""

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.buffers

    def as_dict(self) -> dict:
        return {"weights": self.weights, "grads": self.grads, "optimizer": self.optimizer,
                "buffers": self.buffers, "total": self.total}


@dataclass(frozen=True)
class Placement:
    """Where one GPU's training state lives at the optimizer step."""

    offload: str | None
    """None, ``"optimizer"`` or ``"params"``."""
    device: Bytes
    """On the GPU."""
    host: Bytes
    """In host memory (pinned under CUDA)."""
    disk: Bytes = Bytes()
    """In files (disk offload): the master and the optimizer states."""

    def total(self, category: str) -> int:
        """Bytes of ``category`` (a :class:`Bytes` field) over every placement: what the
        engine's ledger counts in that category."""
        return sum(getattr(b, category) for b in (self.device, self.host, self.disk))

    def host_per_node(self, gpus_per_node: int) -> int:
        """Host memory a node must hold for its ``gpus_per_node`` GPUs' state."""
        return self.host.total * gpus_per_node

    def disk_per_node(self, gpus_per_node: int) -> int:
        """Disk space a node must have for its ``gpus_per_node`` GPUs' files."""
        return self.disk.total * gpus_per_node

    def as_dict(self, gpus_per_node: int | None = None) -> dict:
        out = {"offload": self.offload, "device": self.device.as_dict(),
               "host": self.host.as_dict(), "disk": self.disk.as_dict()}
        if gpus_per_node is not None:
            out["host_per_node"] = self.host_per_node(gpus_per_node)
            out["disk_per_node"] = self.disk_per_node(gpus_per_node)
        return out


def placed_bytes(params: int, dims: ParallelDims, config: ZeroConfig,
                 trainable: int | None = None,
                 shapes: list[tuple[int, ...]] | None = None) -> Placement:
    """Bytes per GPU per category and placement at the optimizer step, as the engine's
    ``memory(by_placement=True)`` reports them in a step pre-hook (every slot unpadded):
    ``config``'s policy places each category (``ShardPolicy.placement``); on disk, the
    master and the states are in files (:func:`on_disk`). ``trainable``: the parameters
    that train, of ``params``; ``shapes``: the parameters', for an optimizer whose state
    depends on them (both as :func:`model_state_bytes` takes them)."""
    check_layout(dims, config)
    return place(params, dims, config, trainable, shapes)


def place(params: int, dims: ParallelDims, config: ZeroConfig, trainable: int | None = None,
          shapes: list[tuple[int, ...]] | None = None) -> Placement:
    """:func:`placed_bytes` on a layout its caller checked (the planner's entry points:
    ``plan_strategy``, ``peak``)."""
    policy, recipe = config.policy, config.recipe
    weights, grads, optimizer = _state_bytes(params, dims, config, trainable, shapes)
    n = owned(params if trainable is None else trainable, dims, policy)
    offloaded = policy.offloads_optimizer
    m = master_bytes(recipe, offloaded)
    # stage 1 keeps its reduced slot beside the full gradients it keeps
    slot = n * recipe.grad_bytes if policy.keeps_local_grads else 0
    copy = n * m if offloaded or (m and recipe.master_dtype != recipe.grad_dtype) else 0
    if not offloaded:
        return Placement(None, Bytes(weights, grads, optimizer, slot + copy), Bytes())
    on_host = policy.where("params") == "host"
    placed = Placement(config.offload,
                       Bytes(0 if on_host else weights, grads, 0, slot),
                       Bytes(weights if on_host else 0, 0, optimizer, copy))
    return on_disk(placed, params, dims, config) if policy.optimizer_on_disk else placed


def pcie_bytes(params: int, dims: ParallelDims, config: ZeroConfig,
               micro_batches: int = 1) -> dict[str, int]:
    """Bytes one GPU moves over its host link per step: ``down`` (device to host, the
    reduced gradient slots in the master dtype, once per micro-batch) and ``up`` (host to
    device: the updated shard in the compute dtype, or with the weight shards on the
    host the shard of every gather, two per micro-batch)."""
    policy, recipe = config.policy, config.recipe
    if not policy.offloads_optimizer:
        return {"down": 0, "up": 0}
    n = owned(params, dims, policy)
    w = recipe.weight_bytes
    up = 2 * micro_batches * n * w if policy.where("params") == "host" else n * w
    return {"down": micro_batches * n * master_bytes(recipe, True), "up": up}


def host_step_bytes(recipe: Recipe) -> int:
    """Bytes per owned element the host step streams: master and moments read and
    written, the fp32 gradient read, the compute copy written when it is cast."""
    m = master_bytes(recipe, True)
    states = recipe.optimizer_bytes - recipe.master_bytes
    cast = recipe.weight_bytes if recipe.weight_bytes != m else 0
    return 2 * (m + states) + m + cast


def sub_group_buffers(owned_elements: int, state_bytes: int, sub_group_size: int) -> int:
    """Host bytes of disk offload's step buffers: up to two sub-groups (one stepping;
    the other written back, then read ahead into) of ``min(G, n)`` elements,
    ``state_bytes`` (master and states) each."""
    if isinstance(sub_group_size, bool) or not isinstance(sub_group_size, int) or (
            sub_group_size < 1):
        raise ValueError(f"sub_group_size={sub_group_size!r} must be an integer >= 1 "
                         "(elements of the optimizer partition stepped at once)")
    if owned_elements <= 0:
        return 0
    groups = ceil_div(owned_elements, sub_group_size)
    return min(2, groups) * state_bytes * min(sub_group_size, owned_elements)


def on_disk(placed: Placement, params: int, dims: ParallelDims,
            config: ZeroConfig) -> Placement:
    """``placed`` (host offload's :class:`Placement`) with the master and the states in
    files: the host keeps the fp32 gradient copy and gains the sub-group buffers of
    ``config.sub_group_size`` elements."""
    n = owned(params, dims, config.policy)
    buffers = sub_group_buffers(n, optimizer_bytes(config), config.sub_group_size)
    host = Bytes(placed.host.weights, placed.host.grads, 0, placed.host.buffers + buffers)
    return Placement(placed.offload, placed.device, host, Bytes(optimizer=placed.host.optimizer))


def disk_io_bytes(params: int, dims: ParallelDims, config: ZeroConfig) -> dict[str, int]:
    """Bytes one GPU's step reads from and writes to its files: the whole partition's
    master and states, each way (none unless ``config`` places them on disk)."""
    if not config.policy.optimizer_on_disk:
        return {"read": 0, "write": 0}
    n = owned(params, dims, config.policy)
    per = optimizer_bytes(config)
    return {"read": per * n, "write": per * n}


def streamed_step(owned_elements: int, sub_group_size: int, host_seconds: float,
                  disk_seconds: float) -> float:
    """Seconds of disk offload's streamed step over ``owned_elements`` in sub-groups of
    ``sub_group_size``: ``host_seconds`` the host step's and ``disk_seconds`` the drive's
    (read, or write) per element; the module's docstring has the formula."""
    sub_group_buffers(owned_elements, 0, sub_group_size)  # names a bad sub_group_size
    if owned_elements <= 0:
        return 0.0
    full, rest = divmod(owned_elements, sub_group_size)
    groups = full + (1 if rest else 0)
    size = lambda k: (sub_group_size if k < full else rest) if 0 <= k < groups else 0  # noqa: E731
    slot = lambda k: max(size(k) * host_seconds,  # noqa: E731
                         (size(k + 1) + size(k - 1)) * disk_seconds)
    # sub-groups 1 … K-3 are whole with whole neighbours (only the last may be short):
    # alike, counted at once, so the planner stays fast for any sub-group size
    ends = {k for k in (0, groups - 2, groups - 1) if k >= 0}
    total = (size(0) + size(groups - 1)) * disk_seconds + sum(slot(k) for k in ends)
    return total + max(0, groups - 3) * slot(1)


def disk_seconds(params: int, dims: ParallelDims, config: ZeroConfig, host_seconds: float,
                 disk_bandwidth: float) -> tuple[float, float]:
    """(the drive's read and write seconds of one GPU's step, what the streamed step
    adds to a host step of ``host_seconds`` an owned element): the step-time model's
    disk terms."""
    n = owned(params, dims, config.policy)
    per = optimizer_bytes(config) / disk_bandwidth
    return (2 * n * per,
            streamed_step(n, config.sub_group_size, host_seconds, per) - n * host_seconds)
