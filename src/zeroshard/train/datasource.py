"""Where a run's batches come from: the built-in corpus, or ``--data`` tokenized once.

With ``--data`` the launcher tokenizes before any rank starts (``prepare_corpus``: a
token file cached beside the data, a progress bar) and hands the ranks what it prepared
through a file named in the environment; each rank opens it (``open_corpus``) and reads
only the rows of each global batch it owns (``batch(..., part=rows)``). Under plain
``torchrun`` there is no launcher: rank 0 prepares, the others wait and then find the
cache.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from .settings import TrainConfig

#: The launcher names the file holding ``prepare_corpus``'s result here.
ENV = "ZEROSHARD_TRAIN_CORPUS"


def tokenized(cfg: TrainConfig, vocab: int, seq_len: int, progress: bool):
    """``prepare_corpus`` for ``cfg`` (a bad input is its DataError, a ValueError: one
    line)."""
    from ..corpus import prepare_corpus

    return prepare_corpus(cfg.data, cfg.hf_model, field=cfg.data_field,
                          val_fraction=cfg.val_fraction, vocab_size=vocab, progress=progress,
                          seq_len=seq_len)


def prepare(cfg: TrainConfig, vocab: int, seq_len: int) -> Path | None:
    """In the launcher: tokenize ``cfg.data`` (or find it cached) and write the result
    for the ranks into a file of its own folder (the caller removes the folder after the
    run; a folder of token files makes more segments than the environment holds). None
    without ``--data``."""
    if not cfg.data:
        return None
    # the bar on a terminal only: in a log it is a stale line beside the run's own
    info = tokenized(cfg, vocab, seq_len, progress=sys.stderr.isatty())
    folder = Path(tempfile.mkdtemp(prefix="zeroshard-corpus-"))
    path = folder / "corpus.json"
    path.write_text(info.to_json(), encoding="utf-8")
    return path


def open_source(cfg: TrainConfig, vocab: int, seq_len: int, rank: int):
    """On a rank: the corpus its batches come from (``batch(split, seed, step, rows,
    seq_len, part=)``)."""
    if not cfg.data:
        from ..data import Corpus

        return Corpus.builtin()
    import torch.distributed as dist

    from ..corpus import PreparedCorpus, open_corpus

    if ENV in os.environ:
        info = PreparedCorpus.from_json(Path(os.environ[ENV]).read_text(encoding="utf-8"))
    else:  # torchrun: rank 0 tokenizes, the others then read its cache
        info = tokenized(cfg, vocab, seq_len, progress=sys.stderr.isatty()) if rank == 0 \
            else None
        dist.barrier()
        if rank:
            info = tokenized(cfg, vocab, seq_len, progress=False)
    return open_corpus(info, seq_len)
