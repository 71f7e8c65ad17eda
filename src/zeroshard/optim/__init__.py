"""Optimizers torch does not ship that the engine can step exactly on shards:
:class:`~zeroshard.optim.lamb.Lamb`, the layer-wise trust ratio of LAMB."""

from .lamb import Lamb, lamb

__all__ = ["Lamb", "lamb"]
