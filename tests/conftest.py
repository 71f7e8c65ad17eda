"""The test suite, in folders by package: ``spec/`` (what a configuration means), ``plan/``
(the planner and its page), ``engine/`` (the runtime on real gloo ranks, against torch
DDP), ``checkpoint/`` (save, load, export, DCP, DeepSpeed's), ``train/`` (``zeroshard
train`` and its data), ``parity/`` (``zs.verify`` and ``zeroshard verify``), ``cli/``
(every command's bad input and messages), ``trainers/`` (Hugging Face's, TRL's and
Lightning's), ``project/`` (the tree's rules, the package).
The main tier is ``pytest``; ``pytest -m slow`` runs the rest (docs/development.md).

Fixtures shared across folders live here; a folder's own beside its tests.
"""

from __future__ import annotations

import os

import pytest

# Models come from configs built in the tests or from local folders: nothing is fetched.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def world():
    """A process group of one in this process (the environment untouched, so commands run
    in-process still launch as a user's would)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
