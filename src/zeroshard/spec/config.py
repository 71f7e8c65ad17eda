"""``ZeroConfig``: what ``zs.shard`` does, validated once at construction.

Every rule that ties an option to a stage lives in ``rules.py``, one message each; the
engine and the planner both meet it through ``ZeroConfig``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .._jsonfile import read_json_object
from .deepspeed import DEEPSPEED_KEYS, is_deepspeed, translate  # noqa: F401 (re-exported)
from .formulas import DDP_BUCKET_BYTES, QUANT_BLOCK, SUB_GROUP_SIZE
from .policy import ShardPolicy
from .recipes import RECIPES, Recipe, get_recipe
from .rules import (  # noqa: F401 (PLANNED_DISK re-exported)
    OFFLOADS,
    PLANNED_DISK,
    check_disk,
    check_stage_options,
    most_at,
)

#: What the optimizer step does with non-finite gradients (``ZeroConfig.nonfinite``): stop
#: every rank with one error, skip the step on every rank (weights and optimizer state
#: untouched), or not check at all (as torch and DDP do).
NONFINITE_POLICIES = ("raise", "skip", "ignore")

#: ``ZeroConfig.activation_checkpointing``'s named modes (an integer k is the other kind:
#: every k-th unit recomputed).
CHECKPOINTING_MODES = ("none", "full", "selective", "full+offload")

#: How ``model.generate()`` meets stage 3's sharded weights (``ZeroConfig.generate_gather``).
GENERATE_GATHERS = ("auto", "whole", "unit")

#: ``mixed_precision`` shorthands -> recipe names.
_PRECISION = {None: "fp32-adamw", "fp32": "fp32-adamw", "bf16": "bf16-mixed-adamw",
              "fp16": "fp16-mixed-adamw"}

def check_checkpointing(mode) -> str | int:
    """``activation_checkpointing`` checked: a named mode, or k >= 1 (a count written as
    text, as a flag gives it, read as the number; 1 is "full")."""
    if isinstance(mode, str) and mode.strip().isdigit():
        mode = int(mode)
    if isinstance(mode, int) and not isinstance(mode, bool):
        if mode < 1:
            raise ValueError(f"activation_checkpointing={mode}; expected one of "
                             f"{', '.join(map(repr, CHECKPOINTING_MODES))} or a count k >= 1 "
                             "(every k-th unit)")
        return "full" if mode == 1 else mode
    if mode not in CHECKPOINTING_MODES:
        raise ValueError(f"activation_checkpointing={mode!r}; expected one of "
                         f"{', '.join(map(repr, CHECKPOINTING_MODES))} or a count k >= 1 "
                         "(every k-th unit)")
    return mode


@dataclass(frozen=True)
class ZeroConfig:
    """Configuration of a sharded model."""

    stage: int = 3
    """ZeRO stage: 0 (DDP), 1 (+ optimizer state sharded), 2 (+ gradients), 3 (+ params)."""
    mixed_precision: str | None = None
    """None or "fp32": fp32 weights, no master copy (4/4/8 bytes per parameter).
    "bf16": bf16 compute weights and gradients, fp32 master and optimizer state
    (2/2/12). "fp16": the same in fp16, which needs dynamic loss scaling
    (``zs.GradScaler``: without one the first step is an error). A recipe name from
    ``zeroshard.plan.RECIPES`` is also accepted, and a :class:`Recipe` itself, taken as
    it is, its ``reduce_dtype`` included (None: the gradients' dtype) unless
    ``reduce_dtype`` is given: the planner's recipes travel so, custom ``W/G/O`` bytes
    included (which describe no dtypes to allocate)."""
    reduce_dtype: str | None = None
    """Dtype gradients are summed in across ranks; None: fp32 under mixed precision
    (one rounding into the stored dtype instead of one per rank), else the gradient
    dtype."""
    units: Any = "blocks"
    """Unit policy (see ``zeroshard.runtime.build.select_units``): "blocks", None,
    module classes, a list of modules, or a parameter count."""
    param_persistence_threshold: int = 0
    """Stage 3: parameters with fewer elements than this stay whole on every rank
    between uses, in one unit that is never released (DeepSpeed's
    ``stage3_param_persistence_threshold``): biases and norms skip the gathers, at the
    price of their full weights on every rank; their gradients and optimizer state stay
    sharded. 0 shards every parameter."""
    prefetch: int = 1
    """Stage 3: units whose all-gather is issued ahead of use, in the order recorded on
    the previous pass (forward, and reversed in backward), so it overlaps the current
    unit's compute. Each prefetched unit adds its full parameters to the peak; 0 gathers
    only on use."""
    prefetch_bucket_size: int = 0
    """Stage 3: if > 0, the units prefetched at once hold at most this many elements
    (DeepSpeed's ``stage3_prefetch_bucket_size``); the next unit is always allowed."""
    reduce_bucket_size: int | None = None
    """If > 0, the gradient reductions of consecutive units share one collective until
    it holds at least this many elements (DeepSpeed's ``reduce_bucket_size``): fewer,
    larger collectives, at the cost of a larger communication buffer; 0: one reduction
    per unit. None (the default): torch DDP's 25 MiB at stage 0 when it sums in the
    gradients' own dtype — its buffers then hold the gradients they replace, so a bucket
    adds nothing to its memory — else 0, as at stages 1-3, where a unit's gradients go
    as soon as its own reduction is issued (FSDP2). At N >= 3 the stages agree bit for
    bit at the same bucket size: the order in which gloo's ring sums an element depends
    on the buffer it travels in."""
    profile: bool = False
    """Record a timeline of unit lifecycle events with bytes per category, activation
    bytes (saved-tensor hooks) and a collective trace (``model.profiler``). Off, the
    engine's events go to no listener."""
    sync_module_states: bool = True
    """Broadcast rank 0's parameters and buffers at shard time, so every rank starts
    from the same weights whatever its seed."""
    broadcast_buffers: bool = True
    """Broadcast rank 0's buffers (BatchNorm's running statistics, counters) before
    every forward with gradients enabled, outside ``no_sync()``, as torch DDP does by
    default: ranks evaluate alike and ``full_state_dict()`` is the same on every rank.
    Off, each rank's buffers follow its own data."""
    check_collectives: bool = True
    """Before each collective the ranks exchange a fingerprint of it — step, phase, kind,
    unit, size — on a small group of their own (``kind="check"`` in ``comm_stats()``),
    and stop, every rank alike, with one error naming what each rank was doing when they
    differ (``runtime/watch.py``). Ranks out of step (one more micro-batch on one rank,
    a mixture of experts routing per rank at stage 3) would otherwise pair unlike
    collectives: wrong weights when the sizes agree, a wait until the timeout when not."""
    shard_group: Any = None
    """Hybrid sharding ([Note: hybrid sharding] in ``mesh.py``): None shards over every
    data-parallel rank; an integer K (dividing the N ranks) shards over groups of K
    consecutive ranks and replicates across the N / K groups — gathers and
    reduce-scatters stay inside a group, one all-reduce of each reduced shard crosses
    between groups — at the price of a memory floor of 16P / K instead of 16P / N;
    "node" is K = the ranks per machine (``LOCAL_WORLD_SIZE``); a torch ``DeviceMesh``
    with dims ("replicate", "shard") gives K as its "shard" size. DeepSpeed's
    ``mics_shard_size``, FSDP2's HSDP."""
    secondary_group: int | None = None
    """Stage 3, hpZ (ZeRO++'s hierarchical partitioning, DeepSpeed's
    ``zero_hpz_partition_size``): after a unit's forward its weights are kept as a
    secondary shard over groups of this many consecutive ranks (dividing the shard
    group), so backward gathers stay inside that group — on the fast links — instead of
    crossing the whole shard group. Costs the unit's weights / K2 per rank from its
    forward to its backward. None: off."""
    quantize_weights: bool = False
    """Stage 3, qwZ (ZeRO++): the weights' all-gathers (forward, and backward where
    hpZ does not keep them) send int8 in blocks of ``quant_block`` with one fp32 scale
    per block, about 1/4 of bf16's bytes; every rank computes with the dequantized
    weights (its own slot included), so ranks stay alike. An approximation of the
    exact run: docs/engine.md states the loss drift measured."""
    quantize_grads: bool = False
    """Stages 1-3, qgZ (ZeRO++): the gradients' reduce-scatter inside the shard group is
    an all-to-all of int8 blocks with fp32 scales, dequantized and summed in fp32 in
    rank order (``runtime/quantize.py``); the all-reduce across replica groups stays
    exact. An approximation, like ``quantize_weights``."""
    quant_block: int = QUANT_BLOCK
    """Elements per quantization block (one fp32 scale each: 1 + 4 / block bytes per
    element). DeepSpeed's weight quantizer works in groups of a few thousand; smaller
    blocks track the values more closely at more bytes (``docs/quantized.md``)."""
    offload: str | None = None
    """Where the optimizer's part lives (ZeRO-Offload; DeepSpeed's ``offload_optimizer``
    / ``offload_param`` with device "cpu", FSDP2's ``CPUOffloadPolicy``): None, all on
    the device; "optimizer" (stages 1-3): the fp32 master and the optimizer state in
    host memory (pinned under CUDA) — each unit's reduced gradient shard goes to the
    host when backward ends, the optimizer steps host tensors (``zeroshard.offload.
    HostAdamW`` steps them fast), and the updated weights return cast to the compute
    dtype on the host first; "params" (stage 3): the weight shards too, copied to the
    device as part of each unit's gather (and prefetched with it). With ``offload_dir``
    the master and the optimizer state go on to disk."""
    offload_dir: str | None = None
    """Disk offload (ZeRO-Infinity; DeepSpeed's ``offload_optimizer`` with device "nvme"
    and its ``nvme_path``): with ``offload`` set, the fp32 master and Adam's two moments
    live in files in a scratch folder of their own under this existing, writable
    directory (one per rank and model, removed when the model goes or the process exits
    cleanly; never a checkpoint), and the optimizer step streams them through host
    memory ``sub_group_size`` elements at a time (``zeroshard.runtime.offload``). The
    files are written in full at ``zs.shard`` time, so a disk too small is an error
    then. None: no disk."""
    sub_group_size: int = SUB_GROUP_SIZE
    """Disk offload: elements of each rank's optimizer partition stepped at once
    (DeepSpeed's ``sub_group_size``: its default is 1e9). The host holds two
    sub-groups of master and moments (12 bytes an element each: one stepping, the other
    written back and then read ahead into) plus the stepping one's cast, whatever the
    model's size."""
    nonfinite: str = "raise"
    """What the optimizer step does when a reduced gradient holds a NaN or inf, decided
    alike on every rank in one small exchange (free when the cycle was clipped: the
    global norm tells): "raise" one error on every rank naming where; "skip" the step
    on every rank, weights and optimizer state untouched (``model.skipped_steps``
    counts them); "ignore": no check, as torch DDP (the step then makes every rank's
    weights non-finite)."""
    activation_checkpointing: str | int = "none"
    """Activations recomputed in backward instead of kept, each unit (but the root) at its
    boundary, where stage 3 gathers it for backward anyway ([Note: activation
    checkpointing] in ``runtime/checkpointing.py``). "none": every activation kept;
    "full": a unit keeps its inputs only and recomputes its forward in backward;
    "selective": a unit keeps its matrix multiplications' outputs (the linear layers')
    and recomputes the rest — elementwise operations, norms, attention's softmax
    (Korthikanti et al.'s selective recompute, through torch's
    ``create_selective_checkpoint_contexts``); an integer k: every k-th unit "full", the
    others none (1 is "full"); "full+offload": "full" with the kept inputs in host
    memory (pinned under CUDA) until the recompute. A model that checkpoints itself
    (transformers' ``gradient_checkpointing_enable``) is kept as it is. DeepSpeed's
    ``activation_checkpointing`` section maps here (``cpu_checkpointing``:
    "full+offload")."""
    generate_gather: str = "auto"
    """Stage 3: how ``model.generate()`` meets the sharded weights. "whole": every unit
    gathered once for the whole generation and released when it returns (one all-gather
    per unit, then no collective per token, so ranks may stop at different lengths),
    the full weights in the compute dtype held meanwhile; "unit": gathered unit by unit
    at every forward, as in training, with transformers' ``synced_gpus`` on so that
    ranks done early keep serving the others' gathers; "auto": "whole" where every
    rank's free memory holds the full weights with a fifth to spare (agreed by the
    ranks), else "unit". Other stages hold their weights whole and need neither."""
    recipe: Recipe = field(init=False)
    """The precision recipe resolved from ``mixed_precision`` and ``reduce_dtype``:
    the same definition the planner computes bytes from."""

    def __post_init__(self) -> None:
        if type(self.stage) is not int or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage={self.stage!r} is not a ZeRO stage; expected 0, 1, 2 or 3")
        given = isinstance(self.mixed_precision, Recipe)
        name = self.mixed_precision if given else _PRECISION.get(self.mixed_precision,
                                                                  self.mixed_precision)
        if not given and name not in RECIPES:
            raise ValueError(
                f"mixed_precision={self.mixed_precision!r} is not supported; expected None, "
                f"'fp32', 'bf16' or a recipe name ({', '.join(RECIPES)})")
        recipe = get_recipe(name)
        # a Recipe's own reduce dtype counts as asked for (the qgZ rule below)
        asked = self.reduce_dtype or (recipe.reduce_dtype if given else None)
        reduce = self.reduce_dtype
        if reduce is None:
            reduce = recipe.reduce_dtype if given else (
                "fp32" if recipe.master_dtype else recipe.grad_dtype)
        for name in ("profile", "sync_module_states", "broadcast_buffers",
                     "check_collectives"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        for name in ("param_persistence_threshold", "prefetch", "prefetch_bucket_size",
                     "reduce_bucket_size"):
            t = getattr(self, name)
            if t is None and name == "reduce_bucket_size":
                continue  # the stage's default (``reduce_bucket``)
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"{name}={t!r} must be an integer >= 0")
        sg = self.shard_group
        if isinstance(sg, str) and sg.isdigit():  # the command line's and JSON's form
            sg = int(sg)
            object.__setattr__(self, "shard_group", sg)
        if not (sg is None or sg == "node" or type(sg).__name__ == "DeviceMesh" or (
                isinstance(sg, int) and not isinstance(sg, bool) and sg >= 1)):
            raise ValueError(f"shard_group={sg!r}; expected None, an integer >= 1 dividing "
                             "the data-parallel ranks, 'node' or a DeviceMesh with dims "
                             "('replicate', 'shard')")
        k2 = self.secondary_group
        if isinstance(k2, str) and k2.isdigit():  # the command line's and JSON's form
            k2 = int(k2)
            object.__setattr__(self, "secondary_group", k2)
        if k2 is not None and (isinstance(k2, bool) or not isinstance(k2, int) or k2 < 1):
            raise ValueError(f"secondary_group={k2!r}; expected None or an integer >= 1 "
                             "dividing the shard group")
        for name in ("quantize_weights", "quantize_grads"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if isinstance(self.quant_block, bool) or not isinstance(self.quant_block, int) or (
                self.quant_block < 1):
            raise ValueError(f"quant_block={self.quant_block!r} must be an integer >= 1")
        if self.offload not in (None, *OFFLOADS):
            raise ValueError(f"offload={self.offload!r}; expected None, 'optimizer' or "
                             "'params'")
        check_stage_options(self.stage, secondary_group=k2,
                            quantize_weights=self.quantize_weights,
                            quantize_grads=self.quantize_grads, reduce_dtype=asked,
                            offload=self.offload)
        check_disk(self)
        object.__setattr__(self, "activation_checkpointing",
                           check_checkpointing(self.activation_checkpointing))
        if self.generate_gather not in GENERATE_GATHERS:
            raise ValueError(f"generate_gather={self.generate_gather!r}; expected one of "
                             f"{', '.join(map(repr, GENERATE_GATHERS))}")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite={self.nonfinite!r}; expected one of "
                             f"{', '.join(map(repr, NONFINITE_POLICIES))}")
        if reduce not in ("fp32", "bf16") and not (given and reduce == recipe.reduce_dtype):
            raise ValueError(f"reduce_dtype={self.reduce_dtype!r}; expected 'fp32' or 'bf16'")
        object.__setattr__(self, "recipe", recipe.with_reduce_dtype(reduce))

    @property
    def reduce_bucket(self) -> int:
        """Elements a gradient reduction gathers before it is issued
        (``reduce_bucket_size``, its default filled in for this stage)."""
        if self.reduce_bucket_size is not None:
            return self.reduce_bucket_size
        rb = self.recipe.reduce_bytes  # stages 1-3, and stage 0 summing in a wider dtype:
        if self.policy.bounds_reductions(self.recipe.grad_bytes, rb):  # buffers add memory
            return 0
        return DDP_BUCKET_BYTES // rb

    @property
    def policy(self) -> ShardPolicy:
        """What this configuration's stage means, with its placements
        (:meth:`ShardPolicy.from_config`)."""
        return ShardPolicy.from_config(self)

    def at_stage(self, stage: int) -> ZeroConfig:
        """This configuration at ``stage`` with the most of its options that stage takes
        (``rules.most_at``): hpZ and qwZ only at stage 3, qgZ at stages 1-3, offload at
        stages 1-3 and the weight shards' at stage 3 only (the optimizer's below it),
        the disk with the offload. The planner shows every stage of a table so."""
        return replace(self, **most_at(stage, self))

    @classmethod
    def from_dict(cls, d: dict) -> ZeroConfig:
        """Our own keys (the field names), or a DeepSpeed config (``zero_optimization``)."""
        if is_deepspeed(d):
            return cls.from_deepspeed(d)
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ZeroConfig keys {unknown}; expected some of {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_deepspeed(cls, d: dict, handled: Iterable[str] = ()) -> ZeroConfig:
        """The DeepSpeed keys zeroshard honours (``spec/deepspeed.py``: ``DEEPSPEED_KEYS``;
        DeepSpeed's defaults for those absent, so no ``zero_optimization.stage`` is stage
        0). Every other key, except those in ``handled`` (a caller's own, such as the
        trainer's batch sizes), is named in one warning. A bad value is an error naming its
        DeepSpeed key and the accepted values."""
        return translate(d, handled, cls)

    @classmethod
    def load(cls, config) -> ZeroConfig:
        """A ZeroConfig from itself, a dict, or a JSON file path."""
        if isinstance(config, ZeroConfig):
            return config
        if isinstance(config, dict):
            return cls.from_dict(config)
        if isinstance(config, (str, Path)) and str(config).strip():
            return cls.from_dict(read_json_object(config, "config"))
        raise ValueError(f"config={config!r}; expected a ZeroConfig, a dict or a JSON file path")


