"""What ``checkpoint-N/`` holds under :class:`zeroshard.hf.Trainer`, and reading it back.

Beside the Trainer's own files (``trainer_state.json``, ``rng_state_R.pth`` per rank,
``scheduler.pt``, the model's ``config.json``), the model and the optimizer are one
zeroshard checkpoint in ``checkpoint-N/zeroshard/`` (``zs.save``: every rank writes its
own rows, nothing is gathered), which loads at any number of ranks and any stage. The
whole weights are not written there (the Trainer's ``save_model`` inside
``_save_checkpoint``): gathering them would put the whole model in every rank's memory
at every save; ``trainer.save_model()`` and ``zeroshard export`` write them.
"""

from __future__ import annotations

from pathlib import Path

import torch

#: The zeroshard checkpoint's folder inside ``checkpoint-N/``.
SHARDED = "zeroshard"
#: Files of whole weights a folder may hold instead (``save_only_model``, a stock
#: Trainer's checkpoint, ``save_model``): ``zs.load_pretrained`` reads them.
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def sharded_dir(checkpoint: str | Path) -> Path:
    """Where a Trainer checkpoint keeps its zeroshard checkpoint."""
    return Path(checkpoint) / SHARDED


def has_sharded(checkpoint: str | Path) -> bool:
    """Whether ``checkpoint`` holds a zeroshard checkpoint (model and optimizer)."""
    return (sharded_dir(checkpoint) / "manifest.json").is_file()


def has_weights(checkpoint: str | Path) -> bool:
    """Whether ``checkpoint`` holds whole weights in safetensors."""
    return any((Path(checkpoint) / name).is_file() for name in WEIGHTS)


def unwrap_optimizer(optimizer):
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (``zs.save`` and
    ``zs.load`` take the optimizer that holds the shards)."""
    while type(optimizer).__name__ == "AcceleratedOptimizer":
        optimizer = optimizer.optimizer
    return optimizer


def save(model, optimizer, checkpoint: str | Path, step: int) -> None:
    """``zs.save`` of the model and the optimizer into ``checkpoint-N/zeroshard``
    (a collective: every rank calls it)."""
    import zeroshard as zs

    zs.save(model, unwrap_optimizer(optimizer), sharded_dir(checkpoint),
            extra={"global_step": step})


def load(model, optimizer, checkpoint: str | Path) -> None:
    """``zs.load`` of ``checkpoint-N/zeroshard`` (weights only when ``optimizer`` is None),
    leaving this process's torch RNG as it was: the Trainer restores its own RNG states
    from ``rng_state_R.pth`` when the epoch resumes (``Trainer._load_rng_state``), as it
    does for any other engine."""
    import zeroshard as zs

    state = torch.get_rng_state()
    try:
        zs.load(model, None if optimizer is None else unwrap_optimizer(optimizer),
                sharded_dir(checkpoint))
    finally:
        torch.set_rng_state(state)
