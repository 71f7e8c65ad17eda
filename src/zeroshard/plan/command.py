"""Until ``cli.py`` names ``zeroshard.commands.plan``: that module, found by name (the
planner package imports no command); delete this file then."""
import importlib

_command = importlib.import_module("zeroshard.commands.plan")
add_arguments, run = _command.add_arguments, _command.run
__doc__ = _command.__doc__  # what `zeroshard plan --help` describes itself with
