"""The ``zeroshard`` command: one subcommand per job, each a module of
``zeroshard.commands`` (its convention is stated there) imported only when it runs.

``zeroshard plan`` must stay torch-free, so no subcommand module is imported here.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from zeroshard._errorline import debugging, line_of, told_plainly
from zeroshard._version import __version__

# subcommand -> (module with add_arguments(parser) and run(args), one-line help); each
# module follows the convention of zeroshard.commands
COMMANDS = {
    "plan": ("zeroshard.commands.plan", "memory and communication per GPU before a run"),
    "train": ("zeroshard.commands.train", "train sharded over N processes: the built-in GPT, "
              "or a local Hugging Face model on your data (--hf-model, --data)"),
    "verify": ("zeroshard.commands.verify", "before a long run: the same flags as train, its "
               "first steps sharded and unsharded, every tensor compared"),
    "export": ("zeroshard.commands.export", "a checkpoint as consolidated safetensors"),
    "inspect": ("zeroshard.commands.inspect", "what a checkpoint holds, checksums checked"),
    "import-deepspeed": ("zeroshard.commands.import_deepspeed", "a DeepSpeed ZeRO checkpoint "
                         "(weights, Adam state) as a zeroshard checkpoint, any N and stage"),
    "bench": ("zeroshard.commands.bench", "benchmarks: unit granularity"),
    "demo": ("zeroshard.commands.demo", "the ZeRO-1 experiment of the source documents on "
             "real processes"),
}


class _Parser(argparse.ArgumentParser):
    """Bad input is one line on stderr and exit code 2, never a usage dump."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {told_plainly(message)}\n")
        raise SystemExit(2)


def _no_empty_values(parser: argparse.ArgumentParser, args) -> None:
    """A value given as an empty string (``--save-dir "$UNSET"``) means nothing to any
    command: refused, naming the flag, rather than read as "not given" or as the current
    folder."""
    for action in parser._actions:
        if getattr(args, action.dest, None) == "":
            name = action.option_strings[-1] if action.option_strings else action.dest
            out = f", or drop {name} for its default" if action.option_strings else ""
            raise ValueError(f"{name}='' is empty (an unset shell variable?); give a value{out}")


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the ``selected`` subcommand's module is imported."""
    parser = _Parser(prog="zeroshard", description="ZeRO stages 0-3 for PyTorch: a planner, "
                     "a trainer, checkpoints and the source documents' demo.")
    parser.add_argument("--version", action="version", version=f"zeroshard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == selected:
            mod = importlib.import_module(module)
            p.description = mod.__doc__
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run, _parser=p)
    return parser


def _warning_line(command: str):
    """``warnings.showwarning`` as one line naming the command (no source line)."""
    def show(message, category, filename, lineno, file=None, line=None):
        (file or sys.stderr).write(f"{command}: warning: {message}\n")
    return show


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = argv[0] if argv and argv[0] in COMMANDS else None
    if selected == "train":  # torch's launcher imports on another core meanwhile
        from zeroshard.train import early

        early.start(argv[1:])
    try:
        return _run(selected, argv)
    finally:
        if selected == "train":
            early.discard()  # unused: the command ended before launching


def _run(selected: str | None, argv: list[str]) -> int:
    args = build_parser(selected).parse_args(argv)
    command = f"zeroshard {args.command}"
    shown = warnings.showwarning
    if not debugging():
        warnings.showwarning = _warning_line(command)
    try:
        _no_empty_values(args._parser, args)
        return args._run(args) or 0
    except BrokenPipeError:  # e.g. `zeroshard plan --json | head`
        sys.stderr.close()
        return 0
    except Exception as exc:
        if debugging():
            raise
        line, code = line_of(exc, command)
        sys.stderr.write(line + "\n")
        return code
    finally:
        warnings.showwarning = shown
