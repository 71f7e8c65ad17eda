"""``TrainConfig``: every setting of ``zeroshard train``, from defaults, a JSON file
(our keys or a DeepSpeed config) and flags, in that order of precedence."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace

from .._jsonfile import read_json_object
from ..models.gpt import PRESETS


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run; validated at construction."""

    nproc: int = 2
    """Local processes to launch (ignored under torchrun, which sets the world)."""
    stage: int = 3
    """ZeRO stage 0-3."""
    precision: str = "fp32"
    """"fp32" (4/4/8 bytes per parameter) or "bf16" (bf16 compute, fp32 master: 2/2/12)."""
    units: str = "blocks"
    """Unit policy: "blocks" (one unit per transformer block), "model" (one unit), or a
    parameter count per unit."""
    param_persistence_threshold: int = 0
    """Stage 3: parameters with fewer elements stay whole on every rank (no gathers)."""
    prefetch_bucket_size: int = 0
    """Stage 3: elements that may be prefetched at once (0: the next unit)."""
    reduce_bucket_size: int = 0
    """Elements per coalesced gradient reduction (0: one reduction per unit)."""
    model: str = "small"
    """Built-in GPT preset: tiny, small or medium."""
    steps: int = 400
    """Optimizer steps."""
    batch: int = 16
    """Global batch in sequences per step, the same at any number of processes."""
    micro_batch: int | None = None
    """Sequences per process per forward; None: batch / N (no accumulation). The number
    of accumulated micro-batches is batch / (N · micro_batch)."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    warmup: int | None = None
    """Linear warm-up steps; None: 10% of the steps. Cosine decay to lr/10 follows."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (parameters with dim >= 2), not biases or norms."""
    clip: float | None = 1.0
    """Global gradient-norm clip; None disables it."""
    seed: int = 0
    """Seed of the initial weights, the batches and the sample."""
    eval_every: int = 100
    """Evaluate train and validation loss every this many steps (and at the end)."""
    eval_batches: int = 4
    """Global batches per evaluation."""
    sample_chars: int = 200
    """Bytes of text sampled from the trained model at the end (0: none)."""
    json_log: str | None = None
    """Write one JSON object per step to this file."""
    save_dir: str | None = None
    """Write sharded checkpoints here (``step-NNNNNN`` and a ``latest`` pointer)."""
    save_every: int | None = None
    """Checkpoint every this many steps (and at the end); None: only at the end."""
    resume: str | None = None
    """Resume from a checkpoint: a path, or "latest" for the newest in ``save_dir``.
    Any --nproc and --stage can resume any checkpoint."""
    profile: str | None = None
    """Profile steps 2-3 (after the first, which records the gather order) and write a
    Chrome trace per rank and the lifetime chart into this directory."""
    init_from: str | None = None
    """Initialise the weights from consolidated safetensors (a file or directory)."""

    def __post_init__(self) -> None:
        def positive(name, allow_none=False):
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive number")

        for name in ("nproc", "steps", "batch", "lr", "eval_every", "eval_batches"):
            positive(name)
        for name in ("micro_batch", "clip", "warmup", "save_every"):
            positive(name, allow_none=True)
        if self.stage not in (0, 1, 2, 3) or isinstance(self.stage, bool):
            raise ValueError(f"stage={self.stage!r} is not a ZeRO stage; expected 0, 1, 2 or 3")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision={self.precision!r}; expected 'fp32' or 'bf16'")
        if self.model not in PRESETS:
            raise ValueError(f"model={self.model!r}; expected one of {', '.join(PRESETS)}")
        if self.units not in ("blocks", "model") and not str(self.units).isdigit():
            raise ValueError(f"units={self.units!r}; expected 'blocks', 'model' or a "
                             "parameter count")
        for name in ("param_persistence_threshold", "prefetch_bucket_size",
                     "reduce_bucket_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.resume == "latest" and not self.save_dir:
            raise ValueError("resume='latest' needs save_dir")
        if self.resume and self.init_from:
            raise ValueError("resume and init_from contradict each other; give one")
        if self.sample_chars < 0 or self.weight_decay < 0:
            raise ValueError("sample_chars and weight_decay must be >= 0")

    def accumulation(self, world: int) -> tuple[int, int]:
        """(micro-batch per process, micro-batches per step) at ``world`` processes."""
        if self.batch % world:
            raise ValueError(f"batch={self.batch} does not divide over {world} processes")
        per_rank = self.batch // world
        micro = self.micro_batch or per_rank
        if per_rank % micro:
            raise ValueError(f"micro_batch={micro} does not divide the {per_rank} sequences "
                             f"each of {world} processes takes from batch={self.batch}")
        return micro, per_rank // micro

    def unit_policy(self):
        return None if self.units == "model" else (
            int(self.units) if str(self.units).isdigit() else "blocks")


#: DeepSpeed keys zeroshard honours -> TrainConfig field.
_DEEPSPEED = {
    "zero_optimization.stage": "stage",
    "bf16.enabled": "precision",
    "gradient_clipping": "clip",
    "train_micro_batch_size_per_gpu": "micro_batch",
    "train_batch_size": "batch",
    "gradient_accumulation_steps": None,  # checked against the other two
    "zero_optimization.stage3_param_persistence_threshold": "param_persistence_threshold",
    "zero_optimization.stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "zero_optimization.reduce_bucket_size": "reduce_bucket_size",
}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def from_deepspeed(ds: dict, nproc: int) -> dict:
    """TrainConfig fields from a DeepSpeed config; every other key is named in one
    warning, and a bad value is an error naming its key."""
    flat = _flatten(ds)
    out, ignored = {}, []
    for key in flat:
        if key not in _DEEPSPEED:
            ignored.append(key)
    if "zero_optimization.stage" in flat:
        out["stage"] = flat["zero_optimization.stage"]
        if out["stage"] not in (0, 1, 2, 3) or isinstance(out["stage"], bool):
            raise ValueError(f"zero_optimization.stage={out['stage']!r} is not a ZeRO stage; "
                             "expected 0, 1, 2 or 3")
    if "bf16.enabled" in flat:
        if not isinstance(flat["bf16.enabled"], bool):
            raise ValueError(f"bf16.enabled={flat['bf16.enabled']!r} must be true or false")
        out["precision"] = "bf16" if flat["bf16.enabled"] else "fp32"
    for key in ("gradient_clipping", "train_micro_batch_size_per_gpu", "train_batch_size",
                "gradient_accumulation_steps"):
        if key in flat:
            v = flat[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (
                    key != "gradient_clipping" and (not isinstance(v, int) or v == 0)):
                raise ValueError(f"{key}={v!r} must be a positive "
                                 f"{'number' if key == 'gradient_clipping' else 'integer'}")
    for key in ("zero_optimization.stage3_param_persistence_threshold",
                "zero_optimization.stage3_prefetch_bucket_size",
                "zero_optimization.reduce_bucket_size"):
        if key in flat:
            v = flat[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or v != int(v):
                raise ValueError(f"{key}={v!r} must be a whole number of elements >= 0")
            out[_DEEPSPEED[key]] = int(v)
    if "gradient_clipping" in flat:
        out["clip"] = flat["gradient_clipping"] or None  # DeepSpeed: 0 means no clipping
    micro = flat.get("train_micro_batch_size_per_gpu")
    gas = flat.get("gradient_accumulation_steps")
    total = flat.get("train_batch_size")
    if total is None and micro is not None:
        total = micro * (gas or 1) * nproc
    if micro is None and total is not None and gas is not None:
        if total % (gas * nproc):
            raise ValueError(f"train_batch_size={total} is not gradient_accumulation_steps="
                             f"{gas} x {nproc} processes x a micro-batch")
        micro = total // (gas * nproc)
    if None not in (micro, gas, total) and micro * gas * nproc != total:
        raise ValueError(f"train_batch_size={total} != train_micro_batch_size_per_gpu={micro} "
                         f"x gradient_accumulation_steps={gas} x {nproc} processes")
    if total is not None:
        out["batch"] = total
    if micro is not None:
        out["micro_batch"] = micro
    if ignored:
        warnings.warn(f"DeepSpeed config keys ignored by zeroshard: {', '.join(sorted(ignored))}",
                      stacklevel=2)
    return out


def resolve(flags: dict, config_path: str | None = None) -> TrainConfig:
    """Defaults, then the JSON file, then the flags that were given (not None)."""
    known = {f.name for f in fields(TrainConfig)}
    values: dict = {}
    if config_path:
        data = read_json_object(config_path, "config")
        nproc = flags.get("nproc") or data.get("nproc") or TrainConfig.nproc
        if "zero_optimization" in data or "bf16" in data or "train_batch_size" in data:
            values = from_deepspeed(data, nproc)
        else:
            unknown = sorted(set(data) - known)
            if unknown:
                raise ValueError(f"config {config_path}: unknown keys {unknown}; expected some "
                                 f"of {sorted(known)} or a DeepSpeed config")
            values = dict(data)
    values.update({k: v for k, v in flags.items() if v is not None and k in known})
    try:
        return replace(TrainConfig(), **values)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
