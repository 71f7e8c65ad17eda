"""The ``zeroshard`` subcommands, one module each: a description, ``add_arguments`` and ``run``."""
