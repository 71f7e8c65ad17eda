"""Checkpoints: sharded save and load at any N and stage, consolidated export and import."""

from .load import load
from .sharded import save

__all__ = ["load", "save", "load_pretrained"]


def __getattr__(name: str):
    if name == "load_pretrained":
        from .consolidated import load_pretrained

        return load_pretrained
    raise AttributeError(name)
