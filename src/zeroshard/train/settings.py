"""``TrainConfig``: every setting of ``zeroshard train`` — the engine's ``ZeroConfig``
nested as ``zero``, the trainer's own beside it — from defaults, a JSON file (our keys, or
a DeepSpeed config) and flags, in that order of precedence."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from .._jsonfile import read_json_object
from ..runtime.scaler import GradScaler
from ..spec.config import ZeroConfig, is_deepspeed
from ..spec.deepspeed import DEEPSPEED_ADAM, SCALER_KEYS, fields_set
from .checks import check_values
from .lrschedule import check_schedule, from_deepspeed_scheduler
from .optimizer import check_optimizer, from_deepspeed_optimizer
from .peftmodel import check_adapters


def processes(n: int) -> str:
    """``n`` processes, in words ("1 process", "2 processes")."""
    return f"{n} process" if n == 1 else f"{n} processes"


def engine_keys() -> list[str]:
    """The ZeroConfig fields the trainer takes, in declaration order: all but ``profile``,
    which follows the trainer's ``profile`` directory."""
    return [f.name for f in fields(ZeroConfig) if f.init and f.name != "profile"]


#: Other names accepted for an engine key in our JSON (the flag has its own alias).
_ALIASES = {"precision": "mixed_precision"}

#: The engine's settings under the trainer: ZeroConfig's defaults, except that a step
#: with non-finite gradients is skipped (and counted) rather than raised.
TRAIN_ZERO = ZeroConfig(nonfinite="skip")


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run; validated at construction."""

    nproc: int = 2
    """Local processes to launch (ignored under torchrun, which sets the world)."""
    zero: ZeroConfig = field(default_factory=lambda: TRAIN_ZERO)
    """The engine's settings, exactly as ``zs.shard`` takes them: stage, mixed_precision,
    reduce_dtype, units, param_persistence_threshold, prefetch, prefetch_bucket_size,
    reduce_bucket_size, sync_module_states (see ``ZeroConfig`` for each). A dict of its
    fields is accepted too. For the built-in GPT ``units`` is "blocks", None (the whole
    model as one unit; "model" on the command line and in JSON) or a parameter count;
    ``zero.profile`` is set from ``profile`` below. ``nonfinite`` defaults to "skip"
    here (``max_skipped`` below bounds it)."""
    model: str = "small"
    """Built-in GPT preset: tiny, small or medium (unused with ``hf_model``)."""
    steps: int = 400
    """Optimizer steps."""
    batch: int = 16
    """Global batch in sequences per step, the same at any number of processes."""
    micro_batch: int | None = None
    """Sequences per process per forward; None: batch / N (no accumulation). The number
    of accumulated micro-batches is batch / (N · micro_batch)."""
    lr: float = 3e-3
    """Peak learning rate."""
    optimizer: str = "adamw"
    """The optimizer, by the planner's names (``zeroshard plan --optimizer``): adamw,
    sgd (with momentum), lamb (``zeroshard.optim.Lamb``), adafactor (torch's), or muon
    (torch's Muon for the hidden matrices, AdamW for the rest: ``train/optimizer.py``)."""
    betas: list | None = None
    """AdamW's and LAMB's (beta1, beta2) (with muon: its AdamW's); None: (0.9, 0.999)."""
    eps: float | None = None
    """AdamW's and LAMB's epsilon (with muon: Muon's and its AdamW's); None: their
    defaults."""
    momentum: float | None = None
    """SGD's momentum (default 0.9) or Muon's (default 0.95)."""
    warmup: int | None = None
    """Warm-up steps; None: 10% of the steps. The decay of ``schedule`` follows."""
    schedule: str = "cosine"
    """After the warm-up: "cosine" or "linear" decay to ``min_lr_ratio`` × lr at
    ``decay_steps``, or "constant" (``train/lrschedule.py``; DeepSpeed's ``scheduler``
    section sets it)."""
    min_lr_ratio: float = 0.1
    """Where the decay ends, as a share of lr."""
    warmup_type: str = "linear"
    """The warm-up's shape: "linear", or DeepSpeed's "log"."""
    warmup_start_ratio: float = 0.0
    """Where the warm-up starts, as a share of lr."""
    decay_steps: int | None = None
    """The step the decay ends at; None: the run's last."""
    weight_decay: float = 0.1
    """Weight decay on matrices (parameters with dim >= 2), not biases or norms (every
    weight with adafactor, which takes one rate)."""
    clip: float | None = 1.0
    """Global gradient-norm clip; None disables it."""
    seed: int = 0
    """Seed of the initial weights, the batches and the sample."""
    eval_every: int = 100
    """Evaluate train and validation loss every this many steps (and at the end)."""
    eval_batches: int = 4
    """Global batches per evaluation."""
    sample_chars: int = 200
    """Text sampled from the trained model at the end (0: none): bytes for the built-in
    GPT; for ``hf_model`` a quarter as many tokens, about as many characters."""
    json_log: str | None = None
    """Write one JSON object per step to this file."""
    save_dir: str | None = None
    """Write sharded checkpoints here (``step-NNNNNN`` and a ``latest`` pointer)."""
    save_every: int | None = None
    """Checkpoint every this many steps (and at the end); None: only at the end."""
    keep_last: int | None = None
    """Keep only the ``keep_last`` checkpoints saved last in ``save_dir``, removing older
    ones after each save (never the one ``latest`` names); None keeps every one."""
    resume: str | None = None
    """Resume from a checkpoint: a path, "latest" for the newest in ``save_dir``, or
    "auto": that one when there is one, else a first start (what a restart needs; see
    ``resume.checkpoint_to_resume``). Any --nproc and --stage can resume any checkpoint."""
    profile: str | None = None
    """Profile steps 2-3 (after the first, which records the gather order) and write a
    Chrome trace per rank and the lifetime chart into this directory."""
    init_from: str | None = None
    """Initialise the weights from consolidated safetensors (a file or directory)."""
    hf_model: str | None = None
    """A Hugging Face causal LM folder (config.json, safetensors weights, a tokenizer) to
    fine-tune instead of the built-in GPT."""
    data: str | None = None
    """Training text: a file, a folder of files, JSON lines (``data_field``) or token
    files, tokenized with ``hf_model``'s tokenizer; None: the built-in corpus."""
    data_field: str = "text"
    """The field of each JSON line that holds its text."""
    val_fraction: float = 0.05
    """Share of ``data`` held out for validation, in (0, 0.5]."""
    seq_len: int | None = None
    """Tokens per sequence; None: the built-in GPT's block size, or for ``hf_model`` the
    smaller of the model's longest sequence and 1024."""
    tensorboard: str | None = None
    """Write TensorBoard scalars into this folder (rank 0)."""
    loss_scaler: dict | None = None
    """fp16's loss scaling as DeepSpeed's ``fp16`` block gives it (``loss_scale``,
    ``initial_scale_power``, ``loss_scale_window``, ``hysteresis``,
    ``consecutive_hysteresis``, ``min_loss_scale``), read by
    ``zs.GradScaler.from_deepspeed`` with DeepSpeed's rule; None: ``zs.GradScaler``'s
    defaults (torch's). Set from a DeepSpeed ``--config`` whose fp16 is enabled."""
    max_skipped: int = 10
    """Consecutive steps skipped for non-finite gradients (``zero.nonfinite="skip"``)
    after which the run stops with an error: a few are a bad batch, ten in a row a run
    that has diverged."""
    timeout: float = 300.0
    """Seconds a rank waits for the others in any collective (every process group the
    engine creates has it too) before it fails, naming the collective. 300 s: far above
    any one collective of these models on one machine, so only a dead or frozen rank
    reaches it, and a run that cannot go on ends in minutes rather than torch's 30."""
    # -- fine-tuning with adapters, and compilation (train/peftmodel.py) --------------------
    lora: int | None = None
    """Fine-tune LoRA adapters of this rank on the frozen model (peft); None: train every
    weight."""
    lora_alpha: float = 8.0
    """The adapters' output is scaled by lora_alpha / lora (peft's default 8)."""
    lora_dropout: float = 0.0
    """Dropout on each adapter's input (peft's default 0)."""
    lora_targets: str | None = None
    """Comma-separated module names to adapt; None: peft's default for the model's family
    (q_proj,v_proj for Llama, Mistral, Qwen2; c_attn for GPT-2), qkv for the built-in GPT."""
    compile: str | None = None
    """torch.compile each unit's forward with this backend ("inductor"); None: eager."""

    # -- tensor parallelism ---------------------------------------------------------------
    tp: int = 1
    """Tensor-parallel degree: each layer's matrices split over ``tp`` consecutive ranks
    (a node's) with torch's own styles — the built-in GPT's plan (``GPT.TP_PLAN``), or
    the one transformers ships for ``hf_model`` — and ZeRO over the ``N / tp``
    data-parallel ranks (``zs.shard(..., mesh=)``). It must divide the processes, the
    heads and the widths it splits."""

    def __post_init__(self) -> None:
        check_values(self)
        check_optimizer(self)
        check_schedule(self)
        check_adapters(self)
        zero = self.zero if isinstance(self.zero, ZeroConfig) else ZeroConfig.load(self.zero)
        units = zero.units
        if units == "model":
            units = None
        elif isinstance(units, str) and units.isdigit():
            units = int(units)
        if isinstance(units, int) and not isinstance(units, bool) and units <= 0:
            raise ValueError(f"units={units} must be a positive parameter count")
        if not (units in ("blocks", None) or (
                isinstance(units, int) and not isinstance(units, bool))):
            raise ValueError(f"units={zero.units!r}; expected 'blocks', 'model' or a "
                             "parameter count")
        if (units, self.profile is not None) != (zero.units, zero.profile):
            zero = replace(zero, units=units, profile=self.profile is not None)
        object.__setattr__(self, "zero", zero)

    def accumulation(self, world: int) -> tuple[int, int]:
        """(micro-batch per process, micro-batches per step) at ``world`` processes; with
        ``tp`` > 1 per data-parallel rank, of which there are ``world / tp`` (the ranks of
        a tensor-parallel group share their micro-batches)."""
        if world % self.tp:
            raise ValueError(f"tp={self.tp} does not divide the {processes(world)}; expected "
                             f"one of {[d for d in range(1, world + 1) if world % d == 0]}")
        world //= self.tp
        if self.batch % world:
            raise ValueError(f"batch={self.batch} does not divide over {processes(world)}"
                             + (" (data-parallel ranks)" if self.tp > 1 else ""))
        per_rank = self.batch // world
        micro = self.micro_batch or per_rank
        if per_rank % micro:
            raise ValueError(f"micro_batch={micro} does not divide the {per_rank} sequences "
                             f"per process that batch={self.batch} gives "
                             f"{processes(world)}")
        return micro, per_rank // micro

    def to_dict(self) -> dict:
        """The settings as JSON-ready data, the engine's under "zero" (``from_dict``
        reads them back)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "zero"}
        out["zero"] = {k: getattr(self.zero, k) for k in engine_keys()}
        return out

    @classmethod
    def from_dict(cls, d: dict, where: str = "config") -> TrainConfig:
        """Our JSON keys: the trainer's fields, and the engine's (ZeroConfig's) at top
        level or under "zero"."""
        return _build(TRAIN_ZERO, *_split(d, where))


#: The DeepSpeed keys the trainer honours on top of the engine's
#: (``zeroshard.spec.deepspeed.DEEPSPEED_KEYS``, translated by ``ZeroConfig.from_deepspeed``),
#: each with the trainer's settings it sets.
TRAINER_FROM_DEEPSPEED = {"gradient_clipping": ("clip",),
                          "train_micro_batch_size_per_gpu": ("micro_batch",),
                          "train_batch_size": ("batch",),
                          "gradient_accumulation_steps": ("batch", "micro_batch")}
TRAINER_DEEPSPEED_KEYS = tuple(TRAINER_FROM_DEEPSPEED)
#: DeepSpeed's sections the trainer reads whole, each into the settings its reader
#: returns (``train/optimizer.py``, ``train/lrschedule.py``).
TRAINER_DEEPSPEED_SECTIONS = {"optimizer": from_deepspeed_optimizer,
                              "scheduler": from_deepspeed_scheduler}


def from_deepspeed(ds: dict, nproc: int) -> dict:
    """TrainConfig keyword arguments from a DeepSpeed config: ``zero`` from the engine's
    one translator (``ZeroConfig.from_deepspeed``), which names every key neither it nor
    the trainer honours in one warning; clipping and the batch sizes here. A bad value
    is an error naming its key."""
    fp16 = ds.get("fp16")
    scaling = {}  # fp16 on: its loss-scaling keys, the trainer's GradScaler's
    if isinstance(fp16, dict) and fp16.get("enabled") is True:
        GradScaler.deepspeed_settings(ds)  # a bad value is named before launch
        scaling = {k: v for k, v in fp16.items() if k in SCALER_KEYS}
    handled = (TRAINER_DEEPSPEED_KEYS + tuple(TRAINER_DEEPSPEED_SECTIONS)
               + tuple(f"fp16.{k}" for k in scaling))
    zero = ZeroConfig.from_deepspeed(ds, handled=handled)
    flat = {k: ds[k] for k in TRAINER_DEEPSPEED_KEYS if k in ds}
    out: dict = {"zero": zero}
    for key, read in TRAINER_DEEPSPEED_SECTIONS.items():  # the scheduler's peak lr last
        if key in ds:
            out.update(read(ds[key]))
    if out.get("optimizer") == "adamw" and "weight_decay" not in out:
        # DeepSpeed's Adam decays nothing unless told (unlike the trainer's 0.1)
        out["weight_decay"] = DEEPSPEED_ADAM["weight_decay"]
    if scaling:
        out["loss_scaler"] = {"enabled": True, **scaling}
    for key, v in flat.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (
                key != "gradient_clipping" and (not isinstance(v, int) or v == 0)):
            raise ValueError(f"{key}={v!r} must be a positive "
                             f"{'number' if key == 'gradient_clipping' else 'integer'}")
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
                             f"{gas} x {processes(nproc)} x a micro-batch")
        micro = total // (gas * nproc)
    if None not in (micro, gas, total) and micro * gas * nproc != total:
        raise ValueError(f"train_batch_size={total} != train_micro_batch_size_per_gpu={micro} "
                         f"x gradient_accumulation_steps={gas} x {processes(nproc)}")
    if total is not None:
        out["batch"] = total
    if micro is not None:
        out["micro_batch"] = micro
    return out


def _split(d: dict, where: str) -> tuple[dict, dict]:
    """Our JSON: (the trainer's fields, the engine's) — engine keys at top level or under
    "zero"; an unknown key or one given twice is an error naming the accepted ones."""
    trainer_keys = [f.name for f in fields(TrainConfig) if f.name != "zero"]
    engine = engine_keys()
    nested = d.get("zero", {})
    if not isinstance(nested, dict):
        raise ValueError(f"{where}: zero={nested!r} must be a JSON object of engine keys "
                         f"({', '.join(engine)})")
    trainer, eng, unknown = {}, {}, []
    for prefix, items in (("", d.items()), ("zero.", nested.items())):
        for key, value in items:
            name = _ALIASES.get(key, key)
            if not prefix and key in trainer_keys:
                trainer[key] = value
            elif name in engine:
                if name in eng:
                    raise ValueError(f"{where}: {name} is given twice (at top level, under "
                                     "'zero' or as an alias); give it once")
                eng[name] = value
            elif prefix and key == "profile":
                raise ValueError(f"{where}: zero.profile follows the trainer's profile, a "
                                 "directory for the trace and chart; give that at top level")
            elif prefix or key != "zero":
                unknown.append(prefix + key)
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; expected some of "
                         f"{trainer_keys}, the engine's {engine} (at top level or under "
                         "'zero'), or a DeepSpeed config")
    return trainer, eng


def _build(zero: ZeroConfig, trainer: dict, engine: dict) -> TrainConfig:
    """``zero`` with ``engine``'s fields replaced, nested in a TrainConfig of ``trainer``'s:
    each validates once, at its construction."""
    try:
        return TrainConfig(zero=replace(zero, **engine), **trainer)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def _from_file(path: str, nproc: int) -> tuple[ZeroConfig, dict, dict]:
    """(the engine's config, the trainer's settings, the engine's settings) of a
    ``--config`` file: our keys, a DeepSpeed config, or both in one file — each key read
    by its own reader; a setting both give is refused by name."""
    where = f"config {path}"
    data = read_json_object(path, "config")
    ours = {k: v for k, v in data.items() if _is_ours(k, v)}
    ds = {k: v for k, v in data.items() if not _is_ours(k, v)}
    if not (is_deepspeed(ds) or any(k in ds for k in [*TRAINER_DEEPSPEED_KEYS,
                                                     *TRAINER_DEEPSPEED_SECTIONS])):
        return (TRAIN_ZERO, *_split(data, where))  # an unknown key is named there
    trainer, engine = _split(ours, where)
    given = {**fields_set(ds), **{name: key for key, names in TRAINER_FROM_DEEPSPEED.items()
                                  if key in ds for name in names},
             **{name: _section_key(key, name) for key, read in
                TRAINER_DEEPSPEED_SECTIONS.items() if key in ds for name in read(ds[key])}}
    if isinstance(ds.get("fp16"), dict) and any(k in ds["fp16"] for k in SCALER_KEYS):
        given["loss_scaler"] = "fp16"
    twice = next((n for n in [*trainer, *engine] if n in given), None)
    if twice is not None:
        raise ValueError(f"{where}: {twice} is given twice, as {given[twice]} (DeepSpeed's "
                         f"key) and as {twice} (zeroshard's); give it once")
    from_ds = from_deepspeed(ds, nproc)
    zero = replace(from_ds.pop("zero"), nonfinite=TRAIN_ZERO.nonfinite)
    return zero, {**from_ds, **trainer}, engine


def _section_key(section: str, name: str) -> str:
    """The DeepSpeed key that set setting ``name`` from ``section`` (for "given twice")."""
    if name == "optimizer":
        return "optimizer.type"
    if section == "scheduler":
        return "scheduler.params.warmup_max_lr" if name == "lr" else "scheduler.params"
    return f"optimizer.params.{name}"


def _is_ours(key: str, value) -> bool:
    """Whether a top-level key of a ``--config`` file is zeroshard's own (a trainer
    setting, an engine setting or an alias, or ``zero``), not DeepSpeed's: DeepSpeed's
    ``optimizer`` is a section (a JSON object), zeroshard's a name."""
    if key in TRAINER_DEEPSPEED_SECTIONS and isinstance(value, dict):
        return False
    return (key == "zero" or key in _ALIASES or key in engine_keys()
            or key in {f.name for f in fields(TrainConfig)})


def resolve(flags: dict, config_path: str | None = None) -> TrainConfig:
    """Defaults, then the JSON file, then the flags that were given (not None). ``flags``
    are named as the fields: the trainer's and the engine's (ZeroConfig's) side by side."""
    trainer_keys = {f.name for f in fields(TrainConfig)} - {"zero"}
    engine_set = set(engine_keys())
    zero, trainer, engine = TRAIN_ZERO, {}, {}
    if config_path:
        zero, trainer, engine = _from_file(config_path, flags.get("nproc") or TrainConfig.nproc)
    given = {k: v for k, v in flags.items() if v is not None}
    trainer.update({k: v for k, v in given.items() if k in trainer_keys})
    engine.update({k: v for k, v in given.items() if k in engine_set})
    if trainer.get("model") is not None and trainer.get("hf_model") is not None:
        raise ValueError(f"model={trainer['model']!r} is a built-in GPT preset and hf_model="
                         f"{trainer['hf_model']!r} a model folder: give one of them")
    return _build(zero, trainer, engine)
