"""Where the documents come from: which files a data path names, what kind each is, and
the documents they hold, read in pieces of bounded size so that no file is ever loaded
whole.

Kinds, by file name and content:

- **token files**: ``*.bin``, a flat array of token ids (nanoGPT's layout), read later
  through a memory map;
- **JSON lines**: ``*.jsonl``, ``*.ndjson`` and ``*.json``, one JSON object per line, the
  document in a string field;
- **text**: any other file whose first 8,000 bytes are UTF-8 without a NUL byte (``.txt``,
  ``.md``, ``.rst``, ``.py``, ``.html``, no extension...); one file is one document, and
  bytes further in that are not UTF-8 read as U+FFFD. Files that are not text (images,
  archives, weights) are skipped in a folder and refused when named alone.

A folder is read recursively in sorted order of relative path; hidden files and folders
(a name starting with ``.``) are skipped. Token files and text do not mix in one folder,
except that a folder with ``train.bin`` and ``val.bin`` (nanoGPT's layout) is read for
those alone, whatever else lies beside them.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import DataError

JSON_LINES = (".jsonl", ".ndjson", ".json")
TOKEN_FILES = (".bin",)
_SNIFF = 8000  # as much as git reads to call a file binary (buffer_is_binary, xdiff-interface.c)
ACCEPTED = ("text files (UTF-8, any extension), JSON lines (.jsonl, .ndjson, .json) "
            "or token files (.bin)")


@dataclass(frozen=True)
class Source:
    """One file of the corpus, with the size and time that key the token cache."""

    path: Path
    kind: str  # "text" | "jsonl" | "tokens"
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Piece:
    """A run of a document's text; ``ends`` marks the document's last piece, after which
    the boundary token goes; ``nbytes`` is how much of the file it consumed."""

    text: str
    ends: bool
    nbytes: int


def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(_SNIFF)
    if b"\0" in head:
        return False
    try:  # not final: the sniff may end inside a multi-byte character
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


def _kind(path: Path) -> str | None:
    suffix = path.suffix.lower()
    if suffix in TOKEN_FILES:
        return "tokens"
    if suffix in JSON_LINES:
        return "jsonl"
    return "text" if _is_text(path) else None


def _source(path: Path, kind: str) -> Source:
    st = path.stat()
    return Source(path.resolve(), kind, st.st_size, st.st_mtime_ns)


def _walk(root: Path) -> Iterator[Path]:
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            p = Path(folder) / name
            if not name.startswith(".") and p.is_file():
                yield p


def find_sources(path: str | os.PathLike) -> tuple[Source, ...]:
    """The corpus files ``path`` names: the file itself, or every usable file below the
    folder (see the module docstring for which)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data path {str(path)!r} does not exist; give a file or a folder "
                        f"of {ACCEPTED}")
    if p.is_file():
        kind = _kind(p)
        if kind is None:
            raise DataError(f"data file {str(path)!r} is not text (it has NUL bytes or is not "
                            f"UTF-8); give {ACCEPTED}")
        return (_source(p, kind),)
    found, skipped = [], []
    for f in _walk(p):
        kind = _kind(f)
        if kind:
            found.append(_source(f, kind))
        else:
            skipped.append(f.name)
    if not found:
        why = f" (skipped as not text: {', '.join(skipped[:3])}" + (
            ", ...)" if len(skipped) > 3 else ")") if skipped else ""
        raise DataError(f"data folder {str(path)!r} has no usable files{why}; it needs "
                        f"{ACCEPTED}")
    tokens = [s for s in found if s.kind == "tokens"]
    if tokens and len(tokens) < len(found):
        named = {s.path.name for s in tokens if s.path.parent == p.resolve()}
        if {"train.bin", "val.bin"} <= named:  # nanoGPT's layout, beside a README or so
            return tuple(tokens)
        raise DataError(f"data folder {str(path)!r} mixes token files (.bin) with text or "
                        "JSON lines; give a folder of one or the other")
    return tuple(found)


def _text_pieces(src: Source, piece_bytes: int) -> Iterator[Piece]:
    """A text file in pieces of about ``piece_bytes``, cut at line ends where lines are
    shorter than that; a file that fits in one piece is one piece, so it is tokenized
    exactly as a whole."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    parts: list[str] = []
    held = pieces = 0
    with open(src.path, "rb") as f:
        while line := f.readline(piece_bytes):
            parts.append(decoder.decode(line))
            held += len(line)
            if held >= piece_bytes:
                yield Piece("".join(parts), False, held)
                parts, held, pieces = [], 0, pieces + 1
        text = "".join(parts) + decoder.decode(b"", final=True)
    if text or pieces:
        yield Piece(text, True, held)


def _json_pieces(src: Source, field: str) -> Iterator[Piece]:
    """One piece per non-blank line: the string in ``field``."""
    with open(src.path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                yield Piece("", False, len(raw))
                continue
            where = f"{src.path}:{number}"
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                why = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
                raise DataError(f"{where} is not JSON ({why}); a JSON-lines file holds one "
                                "JSON object per line") from None
            if not isinstance(record, dict):
                raise DataError(f"{where} is a JSON {type(record).__name__}, not an object; "
                                f"each line holds an object with the text in {field!r}")
            if field not in record:
                has = ", ".join(list(record)[:6]) or "none"
                raise DataError(f"{where} has no field {field!r} (fields: {has}); name the "
                                "field that holds the text (field=, --data-field)")
            text = record[field]
            if not isinstance(text, str):
                raise DataError(f"{where}: field {field!r} is a {type(text).__name__}, not a "
                                "string; name a field that holds text (field=, --data-field)")
            yield Piece(text, bool(text), len(raw))


def read_pieces(sources: tuple[Source, ...], field: str,
                piece_bytes: int = 1 << 16) -> Iterator[Piece]:
    """Every document of the text and JSON-lines ``sources`` in order, as pieces. Empty
    documents (an empty file, an empty string) yield only their byte count: they add no
    tokens and no boundary."""
    for src in sources:
        if src.kind == "text":
            yield from _text_pieces(src, piece_bytes)
        elif src.kind == "jsonl":
            yield from _json_pieces(src, field)
