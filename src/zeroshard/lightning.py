"""``zeroshard.lightning``: ZeRO stages 0-3 as a Lightning strategy.

``Trainer(strategy=ZeroShardStrategy(stage=3), accelerator="cpu", devices=2)``, or by
name once this module is imported: ``strategy="zeroshard"`` (stage 3) and
``"zeroshard_stage_0"`` ... ``"zeroshard_stage_3"``. Lightning documents custom
strategies (``Strategy``, ``StrategyRegistry.register``); this one follows the shape of
Lightning's own sharding strategy (``lightning/pytorch/strategies/fsdp.py``): the
process group as DDP's, the LightningModule sharded by ``zs.shard`` in ``setup``, its
``training_step`` (and validation, test, predict) run through the sharded model by
Lightning's forward redirection (so stage 3 gathers the root unit around it),
accumulation under the sharded model's ``no_sync()`` (``block_backward_sync``),
clipping by the global norm (``ZeroShardPrecision``), and checkpoints that are a folder:
zeroshard's sharded checkpoint (model and optimizers) and Lightning's own state beside it.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Generator
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from ._jsonfile import read_json_object
from .spec.config import ZeroConfig

#: Lightning precisions the strategy runs -> the engine's ``mixed_precision``.
PRECISIONS = {"32-true": None, "32": None, "bf16-mixed": "bf16"}
#: Lightning accelerators the engine computes on (gloo on the CPU, NCCL on CUDA).
ACCELERATORS = ("CPUAccelerator", "CUDAAccelerator")
#: Inside a checkpoint folder: zeroshard's checkpoint, and Lightning's other state.
SHARDED, META = "zeroshard", "meta.pt"


class ZeroShardPrecision(Precision):
    """The precision plugin of :class:`ZeroShardStrategy`: ``"32-true"`` (fp32) or
    ``"bf16-mixed"`` (the engine's bf16 recipe: bf16 compute weights and gradients, an
    fp32 master; the forward under bf16 autocast, as Lightning's ``bf16-mixed`` runs it,
    so fp32 inputs meet the bf16 weights). Clipping by norm is the global norm over every
    rank's shards."""

    def __init__(self, precision: str = "32-true", device: str = "cpu") -> None:
        precision = str(precision)
        if precision not in PRECISIONS:
            raise NotImplementedError(
                f"precision={precision!r} with ZeroShardStrategy: it runs "
                f"{', '.join(repr(p) for p in PRECISIONS if '-' in p)} (bf16 weights with an "
                "fp32 master); fp16 needs zeroshard's loss scaler, which Lightning's loop "
                "does not drive, and '-true' half precisions keep no fp32 master")
        self.precision = "32-true" if precision == "32" else precision
        self.device = device
        self.model = None
        """The sharded model, set by the strategy: what ``clip_grad_by_norm`` clips."""

    def forward_context(self) -> contextlib.AbstractContextManager:
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def optimizer_step(self, optimizer, model, closure, **kwargs: Any) -> Any:
        """The closure (training step, backward, clipping) first, then the step, as
        Lightning's AMP and DeepSpeed plugins run it (``plugins/precision/amp.py``):
        Lightning's default hands the closure to ``optimizer.step(closure=...)``, whose
        backward would then run inside the step, where the engine has begun updating
        the shards (and refuses it)."""
        result = self._wrap_closure(model, optimizer, closure)
        if result is None and getattr(model, "automatic_optimization", True):
            return result  # the training step returned no loss: no step, as Lightning
        optimizer.step(**kwargs)
        return result

    def clip_grad_by_norm(self, optimizer, clip_val: float) -> None:
        """The global norm over every rank's shards (each rank holds some rows: torch's
        ``clip_grad_norm_`` on them would clip by this rank's part of the norm)."""
        self.model.clip_grad_norm_(float(clip_val))


class ZeroShardStrategy(ParallelStrategy):
    """Shards the LightningModule with ``zs.shard`` at ``stage`` (0-3).

    ``config`` and ``options`` are ``zs.shard``'s (a :class:`~zeroshard.ZeroConfig`, a
    dict of its fields, a DeepSpeed config or a JSON path; ``units=``,
    ``reduce_bucket_size=``...); the precision is Lightning's ``precision=``. Every
    rank's ``configure_optimizers`` sees the shards as ``self.parameters()`` and
    ``self.named_parameters()`` (of the module and of each submodule), so the optimizer
    steps the rows this rank owns."""

    strategy_name = "zeroshard"

    def __init__(self, stage: int | None = None, *, config=None,
                 accelerator=None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment=None, checkpoint_io=None, precision_plugin=None,
                 process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, **options: Any) -> None:
        self.zero_config, self._precision_given = _engine_config(stage, config, options)
        """The engine's configuration; unless it states a precision, ``setup`` gives it
        Lightning's."""
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.sharded = None
        """The sharded LightningModule (``trainer.model``), once ``setup`` ran."""

    # -- where it runs ------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        """Lightning asks custom strategies this (``_AcceleratorConnector.is_distributed``)
        before giving each rank its share of the data (a ``DistributedSampler``)."""
        return True

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def accelerator(self):
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator) -> None:
        if accelerator is not None and type(accelerator).__name__ not in ACCELERATORS:
            raise NotImplementedError(
                f"accelerator={type(accelerator).__name__} with ZeroShardStrategy: zeroshard "
                "runs on the CPU (gloo) and CUDA GPUs (NCCL); use accelerator='cpu' or 'gpu'")
        self._accelerator = accelerator

    @property
    def precision_plugin(self) -> ZeroShardPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ZeroShardPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        """Lightning's plugin for ``precision=`` becomes a :class:`ZeroShardPrecision`
        of the same precision (or one line naming a precision the engine cannot run)."""
        if plugin is not None and not isinstance(plugin, ZeroShardPrecision):
            device = getattr(plugin, "device", "cpu")
            plugin = ZeroShardPrecision(getattr(plugin, "precision", "32-true"),
                                        "cuda" if "cuda" in str(device) else "cpu")
        self._precision_plugin = plugin

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment,
                                                       self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        """The process group, as Lightning's DDP and FSDP strategies join it."""
        super().setup_environment()
        reset_seed()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        self._process_group_backend = (self._process_group_backend or
                                       _get_default_process_group_backend_for_device(
                                           self.root_device))
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)

    # -- the model and its optimizers ---------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        """Shard the LightningModule (once: a later ``validate`` or ``fit`` reuses it),
        then build the optimizers over the shards."""
        import zeroshard as zs

        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self.sharded is None or self.sharded.module is not module:
            module.to(self.root_device)
            self.sharded = zs.shard(module, config=self._config_for_precision())
        self.model = self.sharded
        self.precision_plugin.model = self.sharded
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _config_for_precision(self) -> ZeroConfig:
        """The engine's configuration with Lightning's precision; one given to the
        strategy too must agree."""
        from dataclasses import replace

        wanted = PRECISIONS[self.precision_plugin.precision]
        given = self.zero_config.mixed_precision
        name = getattr(given, "name", given)
        if self._precision_given and str(name or "fp32").startswith("bf16") != bool(wanted):
            raise ValueError(
                f"ZeroShardStrategy(mixed_precision={name!r}) against Trainer(precision="
                f"{self.precision_plugin.precision!r}): they must agree ('bf16-mixed' with "
                "bf16, '32-true' with None); set the precision once, in the Trainer")
        return replace(self.zero_config, mixed_precision=wanted) if not self._precision_given \
            else self.zero_config

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """``configure_optimizers`` with the shards as the module's parameters."""
        self._reset_optimizers_and_schedulers()
        with _parameters_are_shards(self.lightning_module, self.sharded):
            super().setup_optimizers(trainer)

    def model_to_device(self) -> None:
        assert self.lightning_module is not None
        self.lightning_module.to(self.root_device)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation: no communication until the last micro-batch's backward."""
        if self.sharded is None:
            yield
            return
        with self.sharded.no_sync():
            yield

    # -- collectives --------------------------------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj, src: int = 0):
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor, group=None, reduce_op="mean"):
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- checkpoints ----------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the shards and the optimizers must exist to load into

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores them with the weights

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the weights go into the folder's zeroshard checkpoint

    def optimizer_state(self, optimizer) -> dict:
        return {}  # likewise the optimizers' state

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # load_checkpoint loaded the weights

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath,
                        storage_options: Any | None = None) -> None:
        """A folder at ``filepath``: ``zeroshard/`` (``zs.save``: every rank its rows of
        the weights and of the optimizers' state, at any N and stage to load) and
        ``meta.pt`` (rank 0: loops, schedulers, callbacks, hyperparameters). Every rank
        calls it, as Lightning's ``ModelCheckpoint`` and ``trainer.save_checkpoint`` do."""
        import zeroshard as zs

        if storage_options is not None:
            raise NotImplementedError("ZeroShardStrategy.save_checkpoint(storage_options=...): "
                                      "the strategy writes its folder itself, not through "
                                      "CheckpointIO")
        path = Path(self.broadcast(str(filepath)))
        checkpoint.pop("state_dict", None)
        with_optimizers = checkpoint.pop("optimizer_states", None) is not None
        zs.save(self.sharded, _optimizers(self.optimizers) if with_optimizers else None,
                path / SHARDED)
        if self.is_global_zero:
            torch.save(checkpoint, path / META)
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        """Weights (and, when fitting, the optimizers' state) from the folder's zeroshard
        checkpoint at any N and stage; Lightning's state from ``meta.pt``."""
        import zeroshard as zs

        path = Path(self.broadcast(str(checkpoint_path)))
        if not (path / META).is_file() or not (path / SHARDED).is_dir():
            raise ValueError(f"ckpt_path={str(checkpoint_path)!r} is not a checkpoint "
                             f"ZeroShardStrategy saved (a folder with {SHARDED}/ and {META})")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        zs.load(self.sharded, _optimizers(self.optimizers) if fitting and self.optimizers
                else None, path / SHARDED)
        return torch.load(path / META, weights_only=False)

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)

    def teardown(self) -> None:
        """As Lightning's FSDP strategy: the module stays where the shards are."""
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """``"zeroshard"`` (stage 3) and ``"zeroshard_stage_K"`` for K = 0..3."""
        strategy_registry.register("zeroshard", cls, "ZeRO stage 3 by zeroshard",
                                   override=True, stage=3)
        for k in range(4):
            strategy_registry.register(f"zeroshard_stage_{k}", cls,
                                       f"ZeRO stage {k} by zeroshard", override=True, stage=k)


def _engine_config(stage, config, options: dict) -> tuple[ZeroConfig, bool]:
    """``zs.shard``'s configuration from ``stage``, ``config`` and ``options`` (checked
    at construction, so a bad option is named before any process group exists), and
    whether it states a precision (``mixed_precision=``, a ZeroConfig, a dict's
    ``mixed_precision`` or DeepSpeed's ``bf16``/``fp16`` sections)."""
    from dataclasses import fields

    if isinstance(config, (str, Path)) and str(config).strip():
        config = read_json_object(config, "config")
    given = "mixed_precision" in options or isinstance(config, ZeroConfig) or (
        isinstance(config, dict) and any(k in config for k in ("mixed_precision", "bf16",
                                                                 "fp16")))
    base = ZeroConfig.load(config) if config is not None else ZeroConfig()
    known = {f.name: getattr(base, f.name) for f in fields(base) if f.init}
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"ZeroShardStrategy() got unknown options {unknown}; accepted: "
                         f"{sorted(known)}")
    if stage is not None:
        options = {**options, "stage": stage}
    return (ZeroConfig(**{**known, **options}) if options else base), given


def _optimizers(optimizers: list) -> list:
    """The torch optimizers inside Lightning's ``LightningOptimizer`` wrappers."""
    return [getattr(o, "_optimizer", o) for o in optimizers]


@contextlib.contextmanager
def _parameters_are_shards(module: torch.nn.Module, sharded) -> Generator[None, None, None]:
    """For the context, ``parameters()`` and ``named_parameters()`` of ``module`` and of
    every submodule yield the shards under their own names (an optimizer built over the
    module's own parameters would not train: each rank steps its shards)."""
    shards = sharded.named_shards()
    patched = []
    for prefix, m in module.named_modules():
        lead = prefix + "." if prefix else ""
        own = [(n[len(lead):], s) for n, s in shards if n.startswith(lead)]

        def named(prefix: str = "", recurse: bool = True, remove_duplicate: bool = True,
                  _own=own):
            for n, s in _own:
                if recurse or "." not in n:
                    yield (prefix + "." + n if prefix else n), s

        def params(recurse: bool = True, _named=named):
            for _, s in _named(recurse=recurse):
                yield s

        m.named_parameters, m.parameters = named, params
        patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.named_parameters, m.parameters


ZeroShardStrategy.register_strategies(StrategyRegistry)
