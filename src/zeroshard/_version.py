"""The package's version, in one place: pyproject.toml reads it (``attr:``), ``zeroshard
--version`` prints it and ``zeroshard.__version__`` re-exports it."""

__version__ = "0.3.0"
