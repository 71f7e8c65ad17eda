"""The subcommands of ``zeroshard``, one module each (``zeroshard.cli`` lists them).

Every module follows one convention. Its docstring is the command's description
(``zeroshard COMMAND --help`` shows it); ``add_arguments(parser)`` declares its flags;
``run(args) -> int`` is a thin adapter: flags into the library's settings, calls into
the library, the results printed, the exit code returned. Bad input is raised as a
``ValueError`` naming the flag, the value and what is accepted, and ``zeroshard.cli``
prints it as one line with exit code 2; no command prints error lines of its own.

A command's module is imported only when that command runs, and this package imports
none of them: ``zeroshard plan`` never imports torch.
"""
