"""The subcommands of ``zeroshard``: one module each, with add_arguments(parser) and run(args)."""
