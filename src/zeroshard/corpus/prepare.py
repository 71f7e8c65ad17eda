"""``prepare_corpus``: once, in the launcher, before any rank starts: find the sources,
tokenize text into the cache (or check token files), and cut the held-out split. What it
returns is small and picklable (file paths and counts), for ``open_corpus`` on each rank.

The held-out (validation) split is the end of the token stream, cut at the document
boundary nearest to ``(1 - val_fraction)`` of its tokens, so no document lies in both
splits. Where no boundary lies within half of ``val_fraction`` of that point (a corpus of
one document, such as a single text file or a token file without boundary ids, or of a
few documents each larger than the held-out share) the stream is cut at that token, as
nanoGPT cuts its one-file corpora, rather than hold out far more or far less than asked.
A folder holding ``train.bin`` and ``val.bin`` keeps its own split (``val_fraction`` is
not used, and its other ``.bin`` files are not read).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .cache import cache_key, cache_root, progress_bar, publish, read_entry, tokenize_to
from .errors import DataError
from .sources import Source, find_sources
from .tokenfile import (
    check_vocabulary,
    check_width,
    choose_dtype,
    largest_id,
    nearest_boundary,
    open_tokens,
)
from .tokenizer import Tokenizer, load_tokenizer

SPLITS = ("train", "val")


@dataclass(frozen=True)
class Segment:
    """Tokens ``start:stop`` of the token file ``path``; a split is one or more."""

    path: str
    dtype: str
    start: int
    stop: int


_Splits = tuple[tuple[Segment, ...], tuple[Segment, ...]]


@dataclass(frozen=True)
class PreparedCorpus:
    """What ``open_corpus`` needs on every rank: the splits as file segments, and the ids
    and counts the trainer reports. ``built`` says whether this call tokenized (False
    when the cache already held the tokens, or for token files)."""

    source: str
    train: tuple[Segment, ...]
    val: tuple[Segment, ...]
    eos_id: int | None
    vocab_size: int
    documents: int | None  # documents in the corpus; None for token files
    cache: str | None  # the cache entry's folder; None for token files
    built: bool

    def to_json(self) -> str:
        """One line of JSON, for handing to ranks through the environment or a file."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PreparedCorpus:
        fields = json.loads(text)
        for split in SPLITS:
            fields[split] = tuple(Segment(**s) for s in fields[split])
        return cls(**fields)

    def tokens(self, split: str) -> int:
        return sum(s.stop - s.start for s in self.segments(split))

    def segments(self, split: str) -> tuple[Segment, ...]:
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not a split; accepted: {', '.join(SPLITS)}")
        return self.train if split == "train" else self.val


def _cut(segments: list[Segment], fraction: float,
         boundary_after: Callable[[Segment, int], int | None]) -> _Splits:
    """Split ``segments`` (one stream) at the boundary nearest to ``1 - fraction`` of it:
    ``boundary_after(segment, position) -> position | None`` finds one inside a segment;
    the joins between segments (separate files) are boundaries too."""
    total = sum(s.stop - s.start for s in segments)
    target = round(total * (1 - fraction))
    edges, at = [], 0
    for s in segments:
        at += s.stop - s.start
        edges.append(at)
    candidates = edges[:-1]
    base = 0
    for s in segments:
        length = s.stop - s.start
        if base <= target < base + length:
            inside = boundary_after(s, target - base)
            if inside is not None:
                candidates.append(base + inside)
        base += length
    near = [c for c in candidates if 0 < c < total and abs(c - target) <= total * fraction / 2]
    cut = min(near, key=lambda c: abs(c - target)) if near else target
    train, val, base = [], [], 0
    for s in segments:
        lo, hi = base, base + s.stop - s.start
        if lo < cut:
            train.append(Segment(s.path, s.dtype, s.start, s.start + min(hi, cut) - lo))
        if hi > cut:
            val.append(Segment(s.path, s.dtype, s.start + max(cut, lo) - lo, s.stop))
        base = hi
    return tuple(train), tuple(val)


def _text(path, sources, tok: Tokenizer, field, fraction, root, vocab, dtype, progress):
    key = cache_key("text", sources, tok.digest, field, dtype, tok.boundary)
    meta, built = read_entry(root, key), False
    tokens = root / key / "tokens.bin"
    if meta is not None and (not tokens.is_file() or tokens.stat().st_size !=
                             meta["tokens"] * np.dtype(dtype).itemsize):
        shutil.rmtree(root / key)  # a damaged entry (a file removed or cut): build it anew
        meta = None
    if meta is None:
        total = sum(s.size for s in sources)
        with progress_bar(progress, total, f"tokenizing {Path(path).name}") as advance:
            meta = publish(root, key, lambda d: tokenize_to(d, sources, tok, field, dtype,
                                                            advance))
        built = True
    if meta["tokens"] == 0:
        raise DataError(f"data path {str(path)!r} holds no text (every file or '{field}' "
                        "field is empty); give files with text in them")
    if meta["largest"] >= vocab:
        raise DataError(f"the tokenizer gives id {meta['largest']:,}, outside the model's "
                        f"vocabulary of {vocab:,}; give the tokenizer saved with the model")
    folder = root / key
    ends = open_tokens(folder / "documents.bin", "uint64")
    whole = [Segment(str(folder / "tokens.bin"), dtype, 0, meta["tokens"])]

    def boundary_after(seg: Segment, pos: int) -> int | None:
        i = int(np.searchsorted(ends, pos))
        near = [int(ends[j]) for j in (i - 1, i) if 0 <= j < len(ends)]
        near = [e for e in near if 0 < e < meta["tokens"]]
        return min(near, key=lambda e: abs(e - pos)) if near else None

    train, val = _cut(whole, fraction, boundary_after)
    return train, val, meta["documents"], str(folder), built


def _token_files(path, sources, boundary, fraction, root, vocab, dtype, progress):
    by_name = {s.path.name: s for s in sources if s.path.parent == Path(path).resolve()}
    named = "train.bin" in by_name and "val.bin" in by_name
    if named:
        sources = (by_name["train.bin"], by_name["val.bin"])
    maps = [open_tokens(s.path, dtype) for s in sources]
    for s, m in zip(sources, maps):
        check_width(s.path, m)
    key = cache_key("tokens", sources, dtype)
    meta = read_entry(root, key)
    if meta is None:
        with progress_bar(progress, sum(s.size for s in sources), "checking token ids") as adv:
            meta = publish(root, key, lambda d: {"largest": [largest_id(m, adv) for m in maps]})
    for s, largest in zip(sources, meta["largest"]):
        check_vocabulary(s.path, largest, vocab)
    segments = [Segment(str(s.path), dtype, 0, len(m)) for s, m in zip(sources, maps)]
    if named:
        return (segments[0],), (segments[1],), None, None, False
    if sum(len(m) for m in maps) == 0:
        raise DataError(f"data path {str(path)!r} holds no tokens (the token files are "
                        "empty); give token files with ids in them")
    mapped = {s.path: m for s, m in zip(segments, maps)}

    def boundary_after(seg: Segment, pos: int) -> int | None:
        return None if boundary is None else nearest_boundary(mapped[seg.path], pos, boundary)

    train, val = _cut(segments, fraction, boundary_after)
    return train, val, None, None, False


def check_length(info: PreparedCorpus, seq_len: int) -> None:
    """Each split holds at least one window of ``seq_len + 1`` tokens."""
    for split in SPLITS:
        n = info.tokens(split)
        if n < seq_len + 1:
            raise DataError(f"the {split} split of {info.source!r} has {n:,} tokens, fewer "
                            f"than seq_len + 1 = {seq_len + 1:,}; give more data, a shorter "
                            "seq_len or (for val) a larger val_fraction")


def prepare_corpus(path: str | os.PathLike, tokenizer_dir: str | os.PathLike | None, *,
                   field: str = "text", val_fraction: float = 0.05,
                   cache_dir: str | os.PathLike | None = None, vocab_size: int | None = None,
                   token_dtype: str | None = None, progress: bool = True,
                   seq_len: int | None = None) -> PreparedCorpus:
    """Make the corpus at ``path`` ready for ``open_corpus``; see the package docstring.
    ``vocab_size`` is the model's (default: the tokenizer's size); ``seq_len``, when
    given, checks here that each split holds a sequence."""
    if not (isinstance(val_fraction, (int, float)) and 0 < val_fraction <= 0.5):
        raise DataError(f"val_fraction={val_fraction!r} is outside (0, 0.5]; give the "
                        "share of documents held out for validation, e.g. 0.05")
    sources: tuple[Source, ...] = find_sources(path)
    text = sources[0].kind != "tokens"
    tok = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    if tok is None and (text or vocab_size is None):
        raise DataError(f"data path {str(path)!r} needs a tokenizer directory"
                        + (" to tokenize its text" if text else " or a vocab_size"))
    vocab = vocab_size if vocab_size is not None else tok.size
    if not (isinstance(vocab, int) and vocab > 0):
        raise DataError(f"vocab_size={vocab_size!r} is not a positive integer")
    root = cache_root(cache_dir)
    if text:
        dtype = choose_dtype(tok.size, token_dtype)
        train, val, docs, cache, built = _text(path, sources, tok, field, val_fraction, root,
                                               vocab, dtype, progress)
    else:
        dtype = choose_dtype(tok.size if tok else vocab, token_dtype)  # what wrote the ids
        train, val, docs, cache, built = _token_files(
            path, sources, tok.boundary if tok else None, val_fraction, root, vocab, dtype,
            progress)
    info = PreparedCorpus(str(path), train, val, tok.boundary if tok else None, vocab, docs,
                          cache, built)
    if seq_len is not None:
        check_length(info, seq_len)
    return info
