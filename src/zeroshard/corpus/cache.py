"""The token cache: text tokenized once into a flat token file and reused by every later
run while nothing it came from has changed.

An entry is a folder named by a hash of everything the tokens depend on: the tokenizer's
files, the JSON field, the token dtype and every source file's path, size and
modification time. It holds ``tokens.bin`` (the ids, document after document, each
followed by the boundary id), ``documents.bin`` (uint64: the position after each
document's boundary id) and ``meta.json`` (counts). An entry is built in a temporary
folder beside it and renamed into place when complete, so a run that is interrupted
leaves no entry that looks valid, and two runs that race both end with a whole one.

The default location is ``$XDG_CACHE_HOME/zeroshard/tokens`` (``~/.cache`` when unset).
Entries for files that have since changed stay until removed by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .sources import Source, read_pieces
from .tokenizer import Tokenizer

FORMAT = 1  # bump when the layout of an entry changes
_BATCH_BYTES = 4 << 20  # text handed to the tokenizer at once: bounded memory, full cores


def cache_root(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "zeroshard" / "tokens"


def cache_key(kind: str, sources: tuple[Source, ...], *parts: object) -> str:
    h = hashlib.sha256(f"zeroshard-tokens:{FORMAT}:{kind}".encode())
    for p in parts:
        h.update(f"\0{p}".encode())
    for s in sources:
        h.update(f"\0{s.path}\0{s.size}\0{s.mtime_ns}".encode())
    return h.hexdigest()[:32]


@contextmanager
def progress_bar(enabled: bool, total: int, what: str) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr over ``total`` bytes; yields the advance function."""
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)


def read_entry(root: Path, key: str) -> dict | None:
    """The meta of a complete entry, or None."""
    try:
        meta = json.loads((root / key / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if meta.get("format") == FORMAT else None


def publish(root: Path, key: str, write: Callable[[Path], dict]) -> dict:
    """Build the entry ``key`` with ``write(folder) -> meta`` in a temporary folder and
    rename it into place; an entry another process completed first wins."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", suffix=".tmp", dir=root))
    try:
        meta = {"format": FORMAT, **write(tmp)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, root / key)
        except OSError:  # the entry appeared meanwhile: keep it
            if read_entry(root, key) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def tokenize_to(folder: Path, sources: tuple[Source, ...], tokenizer: Tokenizer,
                field: str, dtype: str, advance: Callable[[int], None]) -> dict:
    """Stream the documents of ``sources`` through ``tokenizer`` into ``folder``'s
    tokens.bin and documents.bin, ``_BATCH_BYTES`` of text at a time."""
    counts = {"tokens": 0, "documents": 0, "largest": -1}
    with open(folder / "tokens.bin", "wb") as tokens, \
            open(folder / "documents.bin", "wb") as documents:

        def flush(batch: list) -> None:
            texts = [p.text for p in batch if p.text]
            encoded = iter(tokenizer.encode(texts)) if texts else iter(())
            flat: list[int] = []
            ends: list[int] = []
            for p in batch:
                if p.text:
                    flat.extend(next(encoded))
                if p.ends:
                    flat.append(tokenizer.boundary)
                    ends.append(counts["tokens"] + len(flat))
            if flat:
                ids = np.asarray(flat, dtype=np.int64)
                counts["largest"] = max(counts["largest"], int(ids.max()))
                ids.astype(dtype).tofile(tokens)
                np.asarray(ends, dtype=np.uint64).tofile(documents)
                counts["tokens"] += len(flat)
                counts["documents"] += len(ends)
            advance(sum(p.nbytes for p in batch))

        batch, held = [], 0
        for piece in read_pieces(sources, field):
            batch.append(piece)
            held += len(piece.text)
            if held >= _BATCH_BYTES:
                flush(batch)
                batch, held = [], 0
        flush(batch)
    return counts
