"""The ``zeroshard`` command: one subcommand per job, each imported only when run.

``zeroshard plan`` must stay torch-free, so no subcommand module is imported here.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with add_arguments(parser) and run(args), one-line help)
COMMANDS = {
    "plan": ("zeroshard.plan.command", "memory and communication per GPU before a run"),
    "train": ("zeroshard.train", "train the built-in GPT on the built-in corpus over N processes"),
    "export": ("zeroshard.checkpoint.export_cmd", "a checkpoint as consolidated safetensors"),
    "inspect": ("zeroshard.checkpoint.inspect_cmd", "what a checkpoint holds, checksums checked"),
    "bench": ("zeroshard.train.granularity", "benchmarks: unit granularity"),
    "demo": ("zeroshard.demo", "the ZeRO-1 experiment of the source documents on real processes"),
}


class _Parser(argparse.ArgumentParser):
    """Bad input is one line on stderr and exit code 2, never a usage dump."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the ``selected`` subcommand's module is imported."""
    parser = _Parser(prog="zeroshard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == selected:
            mod = importlib.import_module(module)
            p.description = mod.__doc__
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(selected).parse_args(argv)
    try:
        return args._run(args) or 0
    except BrokenPipeError:  # e.g. `zeroshard plan --json | head`
        sys.stderr.close()
        return 0
    except ValueError as exc:
        sys.stderr.write(f"zeroshard {args.command}: error: {exc}\n")
        return 2
    except NotImplementedError as exc:  # a valid request zeroshard does not support
        sys.stderr.write(f"zeroshard {args.command}: not supported: {exc}\n")
        return 2
