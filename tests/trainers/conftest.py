"""The trainers' tests: zeroshard inside Hugging Face's Trainer (and TRL's), and Lightning.

They need the ``hf`` and ``lightning`` extras and TRL (all in ``dev``); without them the
folder is skipped. Multi-process cases run on real gloo ranks through
``zeroshard.runtime.spawn``: one process group per grid, each case inside it guarded
so that one failing case reports its traceback without hiding the next; every number is
held against the same trainer's own DDP run of the plain model."""

from __future__ import annotations

import os

import pytest

for _name in ("transformers", "accelerate", "datasets", "peft", "trl", "lightning"):
    pytest.importorskip(_name)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def ok(result):
    """A case's result, or the case's traceback as the failure."""
    if isinstance(result, dict) and "error" in result:
        pytest.fail(result["error"], pytrace=False)
    return result
