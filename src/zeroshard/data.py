"""The built-in corpus and its byte-level tokenizer.

The text is the Python documentation topics that ship with every CPython installation
(``pydoc_data.topics``, about 465 kB of English prose and code), so training needs no
download. Tokens are the UTF-8 bytes (a vocabulary of 256). The first 90% is the
training split, the rest validation.

Batches are drawn from a generator seeded by (seed, step), and each rank takes its
rows of the *global* batch, so the data a step sees does not depend on N.
"""

from __future__ import annotations

import torch

VOCAB = 256


def corpus_text() -> str:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip it
        raise ValueError("the built-in corpus needs the standard library's pydoc_data, "
                         "which this Python installation lacks") from None
    return "\n\n".join(topics[k] for k in sorted(topics))


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes as int64 token ids."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


class Corpus:
    """Train and validation token streams."""

    def __init__(self, tokens: torch.Tensor, val_fraction: float = 0.1):
        split = int(len(tokens) * (1 - val_fraction))
        self.train, self.val = tokens[:split], tokens[split:]

    @classmethod
    def builtin(cls) -> Corpus:
        return cls(encode(corpus_text()))

    def batch(self, split: str, seed: int, step: int, rows: int, seq_len: int,
              part: slice | None = None):
        """``rows`` random windows of ``seq_len + 1`` tokens: (inputs, targets), each
        ``[rows, seq_len]``; the same for every rank and every N. ``part``: only those
        rows of the global batch (a rank's share), ``[b - a, seq_len]``."""
        data = self.train if split == "train" else self.val
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(data) - seq_len - 1, (rows,), generator=g)
        if part is not None:
            starts = starts[part]
        windows = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]
