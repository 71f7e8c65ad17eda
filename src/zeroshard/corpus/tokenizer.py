"""The model directory's tokenizer: loading it (local files only), the token that marks a
document boundary, and a hash of its files for the token cache's key.

The boundary is the tokenizer's EOS token; a tokenizer without one uses its BOS token
(the token that starts a document also ends the one before it); a tokenizer with neither
is refused, since packed documents would run into each other unmarked. Documents are
encoded without the tokenizer's own special tokens (``add_special_tokens=False``): the
boundary token between documents is the only one added.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from .errors import DataError

# The files a Hugging Face tokenizer is saved as (``save_pretrained``); weights and model
# configs are left out of the hash, so it stays cheap beside a large checkpoint.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "merges.txt", "spiece.model", "sentencepiece.bpe.model",
                    "chat_template.jinja", "chat_template.json")
_NEEDED = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
           "sentencepiece.bpe.model")


@dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer and what the pipeline needs of it."""

    tok: object  # a transformers PreTrainedTokenizerBase
    boundary: int  # the id that ends each document
    size: int  # ids are below this
    digest: str  # hash of the tokenizer files

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens. A fast tokenizer's Rust backend
        encodes the batch on all cores."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is not None:
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        return self.tok(texts, add_special_tokens=False)["input_ids"]


def tokenizer_digest(directory: Path) -> str:
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        p = directory / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def load_tokenizer(directory: str | Path) -> Tokenizer:
    d = Path(directory).expanduser()
    if not d.is_dir():
        raise DataError(f"tokenizer directory {str(directory)!r} is not a folder; give the "
                        "model's directory as save_pretrained wrote it")
    if not any((d / n).is_file() for n in _NEEDED):
        raise DataError(f"tokenizer directory {str(directory)!r} has no tokenizer (none of "
                        f"{', '.join(_NEEDED)}); give the model's directory as "
                        "save_pretrained wrote it")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError("tokenizing text needs transformers (pip install 'zeroshard[hf]'); "
                        "or give pre-tokenized token files (.bin)") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... here
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"tokenizer directory {str(directory)!r} does not load ({first}); "
                        "give the model's directory as save_pretrained wrote it") from None
    boundary = tok.eos_token_id if tok.eos_token_id is not None else tok.bos_token_id
    if boundary is None:
        raise DataError(f"the tokenizer in {str(directory)!r} has neither an EOS nor a BOS "
                        "token to mark document boundaries; set eos_token in its "
                        "tokenizer_config.json")
    return Tokenizer(tok, int(boundary), len(tok), tokenizer_digest(d))
