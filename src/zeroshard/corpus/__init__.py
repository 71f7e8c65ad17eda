"""Training data from the user's files for ``zeroshard train --data PATH``.

In the launcher, once::

    info = prepare_corpus(path, model_dir, field="text", val_fraction=0.05)

finds the files (``sources``), tokenizes text with the model directory's tokenizer into a
token file reused by later runs (``cache``, ``tokenizer``) or checks pre-tokenized token
files (``tokenfile``), and cuts the held-out split at a document boundary (``prepare``).
On each rank::

    corpus = open_corpus(info, seq_len)
    x, y = corpus.batch("train", seed, step, rows, seq_len, part=slice(a, b))

memory-maps the token files and reads only rows ``a:b`` of the global batch of the step
(``store``, in the order of ``order``). Every bad input is a ``DataError``, one line.
The built-in byte-level corpus (``zeroshard.data``) keeps the same ``batch`` contract.
"""

from .errors import DataError
from .prepare import PreparedCorpus, Segment, prepare_corpus
from .store import PackedCorpus, open_corpus

__all__ = ["DataError", "PackedCorpus", "PreparedCorpus", "Segment", "open_corpus",
           "prepare_corpus"]
