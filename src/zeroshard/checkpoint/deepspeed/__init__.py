"""DeepSpeed ZeRO checkpoints in: ``import_deepspeed(DIR, OUT)`` writes a DeepSpeed
stage 1-3 checkpoint (fp32 weights, Adam state) as a zeroshard checkpoint that loads at
any N and stage, reading the rank files a slice at a time (layouts: ``layout.py``)."""

from .convert import import_deepspeed

__all__ = ["import_deepspeed"]
