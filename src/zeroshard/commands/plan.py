"""``zeroshard plan``: the planner's command, still defined in ``zeroshard.plan.command``;
its docstring, imported with it, is the description shown."""

from zeroshard.plan.command import __doc__, add_arguments, run  # noqa: F401
