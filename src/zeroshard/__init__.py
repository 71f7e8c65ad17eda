"""zeroshard: ZeRO stages 0–3 for PyTorch, a planner, and a byte ledger.

``import zeroshard`` stays light: the engine (and torch) load on first use of an
engine name, so ``zeroshard.plan`` and ``zeroshard plan`` never import torch.
"""

from __future__ import annotations

import importlib

from zeroshard._version import __version__

# name -> module that defines it; imported on first attribute access (PEP 562).
_LAZY = {
    "init_distributed": "zeroshard.runtime.dist",
    "shard": "zeroshard.api",
    "ShardedModel": "zeroshard.runtime.model",
    "ZeroConfig": "zeroshard.spec.config",
    "init_weights": "zeroshard.runtime.build",
    "save": "zeroshard.checkpoint",
    "load": "zeroshard.checkpoint",
    "load_pretrained": "zeroshard.checkpoint",
    "GradScaler": "zeroshard.runtime.scaler",
    "verify": "zeroshard.parity",
    # the errors a run can meet on every rank alike (docs/faults.md)
    "NonFiniteGradients": "zeroshard.runtime.stepping",
    "RanksOutOfStep": "zeroshard.runtime.watch",
    "CollectiveTimeout": "zeroshard.runtime.watch",
    "SaveFailed": "zeroshard.checkpoint.sharded",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zeroshard' has no attribute {name!r}")
