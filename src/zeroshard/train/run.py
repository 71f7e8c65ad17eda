"""One rank's run of ``zeroshard train`` as one object: what set-up makes, and what the
other parts of the loop (resume, the step, evaluation, saving, the end) read and
advance. Each part takes the ``Run`` (and the step it works on), so a part can be
replaced (a restart that resumes differently) without threading a dozen values through
the rest."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import torch

from ..corpus.store import PackedCorpus
from ..data import Corpus
from ..runtime.model import ShardedModel
from ..runtime.scaler import GradScaler
from .board import Board
from .hfmodel import BuiltinGPT, HFCausalLM
from .optimizer import Schedules
from .report import Reporter
from .settings import TrainConfig


@dataclass
class Run:
    """A run on this rank (``loop.set_up`` makes it)."""

    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    """Where the model computes; batches are made on the host, the same on every rank."""
    micro: int
    """Sequences per process per forward."""
    accum: int
    """Micro-batches per optimizer step."""
    source: BuiltinGPT | HFCausalLM
    """The model's kind: its sequence length, loss and sample."""
    model: ShardedModel
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer]
    """``--optimizer``'s: one, or Muon's pair (``train/optimizer.py``)."""
    scheduler: torch.optim.lr_scheduler.LambdaLR | Schedules
    scaler: GradScaler
    corpus: Corpus | PackedCorpus
    out: Reporter
    """Rank 0's output (a no-op elsewhere)."""
    unit_params: list[int]
    """Each unit's elements (the summary plans hpZ and quantized slots per unit)."""
    checkpoint: str | Path | None
    """What ``resume.resume`` loads (``resume.checkpoint_to_resume``); None: a first start."""
    log: IO[str] | None = None
    """The JSON log, one object per step (rank 0, with ``json_log``)."""
    board: Board | None = None
    """TensorBoard's writer, made once the step the run starts from is known."""
    start: int = 0
    """The step the run starts from: 0, or the resumed checkpoint's."""
    first_eval: float = math.nan
    """The validation loss before the first step."""
    losses: list[float] = field(default_factory=list)
    """Each step's mean loss over ranks."""
    evals: list[tuple[int, float, float]] = field(default_factory=list)
    """(step, train loss, validation loss) of each evaluation."""
    comm: dict[str, dict[str, int]] = field(default_factory=dict)
    """Calls and bytes per collective kind over the training steps (evaluations and
    saves left out)."""
    skipped_in_a_row: int = 0
    """Consecutive steps skipped for non-finite gradients."""
    skipped_before: int = 0
    """Steps skipped before the step resumed from (the checkpoint's count)."""
    nodes: list[str] = field(default_factory=list)
    """Each rank's node (``restart.node``): a checkpoint keeps them, so a restart at a
    smaller world can name the ranks lost."""
    held: list[dict[str, int]] = field(default_factory=list)
    """The memory summary, read during the last step where every category is live."""

    @property
    def seq_len(self) -> int:
        return self.source.seq_len

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients over the whole run, restarts included."""
        return self.skipped_before + self.model.skipped_steps
