"""``zeroshard.hf.Trainer``: Hugging Face's ``Trainer`` over a model zeroshard shards.

accelerate has no place for a third engine (its ``DistributedType`` is closed and
``Accelerator.prepare`` knows DeepSpeed, Megatron, FSDP, else DDP), but the Trainer
has one: when ``_wrap_model`` returns something other than ``self.model`` it leaves the
model alone and prepares only the optimizer (transformers 5.25, ``trainer.py``,
``Trainer._prepare_for_training``: ``use_accelerator_prepare = model is self.model``).
So :class:`ZeroShardMixin` shards the model once the Trainer is built (its process
group exists then: ``TrainingArguments._setup_devices``), keeps the Trainer's
``self.model`` the user's model (as the Trainer keeps it under DeepSpeed, whose engine
is ``self.model_wrapped``) and returns the :class:`ShardedModel` from ``_wrap_model``,
and overrides what acts on the weights, the gradients or the optimizer state:

- the optimizer is built over the shards, with the Trainer's decay groups by the
  module's own names (``create_optimizer``, ``get_decay_parameter_names``); a DeepSpeed
  config's optimizer and scheduler sections as DeepSpeed builds them (``schedules.py``);
- clipping and the logged norm are the global norm over every rank's shards
  (``_clip_grad_norm``, ``_get_grad_norm``, which ask accelerate's ``clip_grad_norm_``
  otherwise: it would see this rank's rows only);
- accumulation needs nothing: the Trainer enters ``accelerator.no_sync(model)`` on every
  micro-batch but the last, and accelerate calls the model's own ``no_sync()``
  (``Accelerator.no_sync``), which the sharded model honours;
- checkpoints are zeroshard's (``checkpoint.py``), ``save_model`` writes whole weights
  ``from_pretrained`` loads (a peft model: the adapter, gathered).

Everything else is the Trainer's, or the subclass's (TRL's ``SFTTrainer``:
``sharded(SFTTrainer)``), unchanged: data, loss and its scaling over accumulation
(``num_items_in_batch``), evaluation, prediction, logging, callbacks, RNG states.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import transformers
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings
from transformers.utils import check_torch_load_is_safe, logging

from ..runtime.model import ShardedModel
from ..spec.optimizers import ELEMENTWISE, REFUSED, STEPPED, supported
from . import checkpoint as ckpt
from .resolve import check_arguments, fill_steps, resolve
from .schedules import deepspeed_optimizer, deepspeed_scheduler

logger = logging.get_logger(__name__)

#: The Trainer's methods this module overrides or relies on (transformers 5; 4.x clipped
#: inside its training loop, where no override reaches).
_NEEDED = ("_wrap_model", "_clip_grad_norm", "_get_grad_norm", "_save_optimizer_and_scheduler",
           "_load_optimizer_and_scheduler", "_load_from_checkpoint", "_load_best_model",
           "get_decay_parameter_names", "create_scheduler")
_missing = [n for n in _NEEDED if not hasattr(transformers.Trainer, n)]
if _missing:
    raise ImportError(f"zeroshard.hf needs a transformers Trainer with {', '.join(_missing)} "
                      f"(transformers 5; this is {transformers.__version__}): pip install "
                      "'zeroshard[hf]'")

#: ``max_norm`` for reading the global norm without clipping: every factor is 1.0.
_NO_CLIP = float(torch.finfo(torch.float32).max)


class ZeroShardMixin:
    """Put before a ``transformers.Trainer`` subclass (``class T(ZeroShardMixin,
    SFTTrainer)``, or :func:`sharded`) to train it on a model zeroshard shards.

    ``zero``: a :class:`~zeroshard.ZeroConfig`, a dict of its fields, a DeepSpeed config
    dict, or the path of a JSON file of either; ``"auto"`` values are filled from the
    ``TrainingArguments`` as the Trainer fills them for DeepSpeed, and a precision the
    config leaves open follows ``bf16=``. None: ``ZeroConfig()``'s defaults (stage 3).
    Every other argument is the Trainer's."""

    zs_model: ShardedModel | None = None
    """The sharded model (also ``trainer.model_wrapped``); ``trainer.model`` stays the
    module it wraps."""

    def __init__(self, *args, zero=None, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            check_arguments(training_args, kwargs.get("optimizers"), kwargs.get("model_init"))
        model = kwargs.get("model", args[0] if args else None)
        if isinstance(model, ShardedModel):
            raise ValueError(
                "zeroshard.hf.Trainer got a model zs.shard() already sharded: give it the "
                "module itself, and the sharding as zero= (zero={'stage': "
                f"{model.stage}}}); it shards the model once the process group exists")
        self._zero = zero
        self._zs_in_checkpoint = False
        super().__init__(*args, **kwargs)
        check_arguments(self.args, (self.optimizer, None), self.model_init)
        self._shard_model()

    def _shard_model(self) -> None:
        """Shard ``self.model`` as ``zero=`` says: after the Trainer's own set-up, which
        joined the process group (a group of one when nothing launched several)."""
        import zeroshard as zs

        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1 and self.args.world_size == 1:
            raise ValueError(
                f"WORLD_SIZE={launched} (a launcher started {launched} processes) but the "
                "TrainingArguments set up one process, so each would train alone on all the "
                "data; without a GPU pass TrainingArguments(use_cpu=True), which makes "
                "accelerate join the launcher's process group")
        if not dist.is_initialized():
            zs.init_distributed()
        resolved = resolve(self._zero, self.args, self.model)
        self.zero_config = resolved.config
        """The :class:`ZeroConfig` the model was sharded with."""
        self._ds_optimizer, self._ds_scheduler = resolved.optimizer, resolved.scheduler
        self.zs_model = zs.shard(self.model, config=resolved.config)
        self.model_wrapped = self.zs_model

    # -- the model the Trainer runs ---------------------------------------------------
    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """The sharded model, for training, evaluation and prediction alike: the Trainer
        then skips ``accelerator.prepare`` of the model (no DDP around it)."""
        return self.zs_model

    # -- the optimizer and the scheduler ----------------------------------------------
    def create_optimizer(self, model=None):
        """The Trainer's optimizer (``optim=``, ``optimizer_cls_and_kwargs=``, decay
        groups) over the shards, or a DeepSpeed config's; one that cannot step shards
        at this stage is refused here rather than at the first step."""
        if self.optimizer is None:
            if self._ds_optimizer is not None:
                self.optimizer = deepspeed_optimizer(self._ds_optimizer,
                                                     self.zs_model.parameters())
            else:
                super().create_optimizer(self.zs_model)
            _check_steppable(self.optimizer, self.zs_model, self.args.optim)
        return self.optimizer

    def get_decay_parameter_names(self, model) -> list[str]:
        """The Trainer's names (``get_parameter_names`` walks children) of the module
        itself: the sharded model's ``named_parameters()`` gives the shards under those
        names, while walking its children would prefix them with ``module.``."""
        if model is self.zs_model:
            model = self.zs_model.module
        return super().get_decay_parameter_names(model)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The Trainer's scheduler, or a DeepSpeed config's, its step counts filled."""
        if self.lr_scheduler is None and self._ds_scheduler is not None:
            section = fill_steps(self._ds_scheduler, num_training_steps,
                                 self.args.get_warmup_steps(num_training_steps))
            self.lr_scheduler = deepspeed_scheduler(section, optimizer or self.optimizer)
            self._created_lr_scheduler = True
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    # -- clipping and the logged norm -------------------------------------------------
    def _clip_grad_norm(self, model):
        """Clip by the global norm over every rank's shards; return it (logged as
        ``grad_norm``)."""
        return self.zs_model.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        """The global norm; without clipping (``max_grad_norm=0``) read with factors of 1."""
        if grad_norm is None:
            grad_norm = self.zs_model.clip_grad_norm_(_NO_CLIP)
        return grad_norm

    # -- checkpoints ------------------------------------------------------------------
    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, whose model and optimizer are one zeroshard
        checkpoint (``checkpoint.py``)."""
        self._zs_in_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._zs_in_checkpoint = False

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Whole weights that ``from_pretrained`` loads (a peft model: its adapter), with
        the config, the tokenizer and the arguments; every rank must call it (the
        weights are gathered). Inside a checkpoint only the config and the rest:
        ``_save_optimizer_and_scheduler`` writes the weights sharded."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self._zs_in_checkpoint and not self.args.save_only_model:
            self._save_beside_weights(output_dir, config=True)
            return
        if _is_peft(self.model):  # zeroshard's peft save_pretrained gathers the adapter
            if self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
            self.model.save_pretrained(output_dir, is_main_process=self.args.should_save)
            self._save_beside_weights(output_dir)
        else:
            self._save(output_dir, state_dict=self.zs_model.full_state_dict())
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_beside_weights(self, output_dir: str, config: bool = False) -> None:
        """What ``Trainer._save`` writes beside the weights (the processing class, the
        training arguments), and with ``config`` the model's config."""
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        if config and hasattr(getattr(self.model, "config", None), "save_pretrained"):
            self.model.config.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif getattr(self.data_collator, "tokenizer", None) is not None:
            self.data_collator.tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The model and the optimizer as one zeroshard checkpoint (every rank its rows),
        the scheduler as the Trainer saves it."""
        ckpt.save(self.zs_model, self.optimizer, output_dir, self.state.global_step)
        if self.args.should_save:
            with warnings.catch_warnings(record=True) as caught:
                torch.save(self.lr_scheduler.state_dict(),
                           os.path.join(output_dir, SCHEDULER_NAME))
            reissue_pt_warnings(caught)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Whole weights (``save_only_model``, a stock Trainer's checkpoint) are read into
        the shards here; a zeroshard checkpoint loads with the optimizer
        (``_load_optimizer_and_scheduler``), which does not exist yet."""
        import zeroshard as zs

        if ckpt.has_sharded(resume_from_checkpoint):
            return
        if ckpt.has_weights(resume_from_checkpoint):
            zs.load_pretrained(self.zs_model, resume_from_checkpoint)
            return
        raise ValueError(
            f"resume_from_checkpoint={str(resume_from_checkpoint)!r} holds neither a zeroshard "
            f"checkpoint ({ckpt.SHARDED}/manifest.json) nor model.safetensors; give a "
            "checkpoint-N folder zeroshard.hf.Trainer saved")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Model and optimizer from ``checkpoint-N/zeroshard`` at any N and stage, then the
        scheduler. A checkpoint of whole weights has no optimizer state to restore (as a
        stock checkpoint without ``optimizer.pt``)."""
        if checkpoint is None or not ckpt.has_sharded(checkpoint):
            return
        ckpt.load(self.zs_model, self.optimizer, checkpoint)
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(path):
            with warnings.catch_warnings(record=True) as caught:
                check_torch_load_is_safe()
                self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
            reissue_pt_warnings(caught)

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's weights into the shards."""
        import zeroshard as zs

        best = self.state.best_model_checkpoint
        if ckpt.has_sharded(best):
            ckpt.load(self.zs_model, None, best)
        elif ckpt.has_weights(best):
            zs.load_pretrained(self.zs_model, best)
        else:
            logger.warning(f"Could not locate the best model at {best}: no {ckpt.SHARDED}/ "
                           "and no model.safetensors; training ends with the last weights")


class Trainer(ZeroShardMixin, transformers.Trainer):
    """``transformers.Trainer`` on a model zeroshard shards: ``from zeroshard.hf import
    Trainer`` in place of ``from transformers import Trainer``, and ``zero=`` (see
    :class:`ZeroShardMixin`) beside the Trainer's own arguments."""


def sharded(trainer_cls: type) -> type:
    """``trainer_cls`` (a ``transformers.Trainer`` subclass: TRL's ``SFTTrainer``,
    ``DPOTrainer``...) with :class:`ZeroShardMixin` in front: it takes ``zero=`` and
    trains on the sharded model, its own code unchanged."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, transformers.Trainer)):
        raise ValueError(f"sharded() takes a transformers.Trainer subclass; got {trainer_cls!r}")
    if issubclass(trainer_cls, ZeroShardMixin):
        return trainer_cls
    return type(f"ZeroShard{trainer_cls.__name__}", (ZeroShardMixin, trainer_cls),
                {"__module__": trainer_cls.__module__, "__doc__": sharded.__doc__})


def _is_peft(model) -> bool:
    """Whether ``model`` is a peft model (without importing peft where it is absent)."""
    return any(c.__module__.startswith("peft.") and c.__name__ == "PeftModel"
               for c in type(model).__mro__)


def _check_steppable(optimizer, model: ShardedModel, optim: str) -> None:
    """Refuse at construction an optimizer the engine would refuse at the first step:
    one whose update reads more than a rank's rows and is not the class zeroshard steps
    under its name (transformers' own ``Adafactor`` for ``optim="adafactor"``)
    (``spec/optimizers.py``)."""
    inner = ckpt.unwrap_optimizer(optimizer)
    name = type(inner).__name__
    if not model.policy.checks_elementwise or name in ELEMENTWISE or dist.get_world_size() == 1:
        return
    ours = name in STEPPED and type(inner).__module__.startswith(("torch.optim", "zeroshard."))
    if name in REFUSED or (name in STEPPED and not ours):
        where = f"{type(inner).__module__}.{name}"
        given = getattr(optim, "value", optim)  # an OptimizerNames member, or its string
        raise ValueError(
            f"optim={given!r} builds {where}, which cannot step ZeRO stage {model.stage} "
            "shards: its update reads whole tensors, and each rank holds some rows; use "
            f"stage 0, or an optimizer zeroshard steps on shards ({supported()}), through "
            "optim= or optimizer_cls_and_kwargs=")
