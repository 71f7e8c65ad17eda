"""zeroshard inside Hugging Face's ``Trainer`` (and the trainers built on it: TRL's
``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``).

``from zeroshard.hf import Trainer`` in place of ``from transformers import Trainer``,
with ``zero=`` beside the Trainer's arguments; ``sharded(SFTTrainer)`` gives any
Trainer subclass the same. Needs ``pip install 'zeroshard[hf]'``.
"""

from .trainer import Trainer, ZeroShardMixin, sharded

__all__ = ["Trainer", "ZeroShardMixin", "sharded"]
