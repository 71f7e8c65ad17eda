"""The one error class of the data pipeline."""

from __future__ import annotations


class DataError(ValueError):
    """Bad data given to ``zeroshard train --data``: one line naming the bad value (a path,
    a file and line, an id) and what would be accepted. A ``ValueError``, as every bad
    input in zeroshard is."""
