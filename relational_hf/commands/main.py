"""The `relational-hf` command: train | finetune | convert | compress | export | canonicalize | evaluate | redundancy |
analyze | dynamics | push | bench.

Each command is one module of `relational_hf.commands` with the same parts: `HELP` (one line), its docstring (the
description), `Arguments` (its options as a dataclass, `relational_hf.commands.options`) and `run(args)`.

A mistake the user can fix (a flag out of range, a missing, binary or non-UTF-8 file, an output directory that would
be overwritten, a model path that does not exist) ends with one line, ``relational-hf <command>: error: <message>``,
and exit status 2; ``--debug`` shows the traceback instead."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from types import ModuleType

from ..errors import UsageError

#: the commands in the order `relational-hf --help` lists them (module name = command name)
COMMANDS: tuple[str, ...] = (
    "train",
    "finetune",
    "convert",
    "compress",
    "export",
    "canonicalize",
    "evaluate",
    "redundancy",
    "analyze",
    "dynamics",
    "push",
    "bench",
)

# Errors a user can cause and fix: reported in one line. Anything else is a bug and keeps its traceback.
USER_ERRORS = (UsageError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
REPORTED_ERRORS = (*USER_ERRORS, RuntimeError, OSError)


def command_module(name: str) -> ModuleType:
    """The module of command `name`."""
    return importlib.import_module(f"{__package__}.{name}")


def _add_command(sub: argparse._SubParsersAction, name: str) -> None:
    module = command_module(name)
    options = module.Arguments.option_parser(add_help=False)
    parser = sub.add_parser(
        name,
        help=module.HELP,
        description=module.__doc__,
        parents=[options],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.Arguments.add_to(parser)
    parser.set_defaults(_command=name)


def build_parser(commands: tuple[str, ...] = COMMANDS) -> argparse.ArgumentParser:
    """The `relational-hf` parser with a sub-parser per command."""
    parser = argparse.ArgumentParser(
        prog="relational-hf",
        description=__doc__.split("\n\n")[0],
        epilog="Run `relational-hf COMMAND --help` for the flags of a command.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in commands:
        _add_command(sub, name)
    return parser


def _execute(name: str, namespace: argparse.Namespace, debug: bool) -> int:
    """Build the command's checked options from `namespace` and run it; user errors in one line (exit 2)."""
    module = command_module(name)
    try:
        code = module.run(module.Arguments.from_namespace(namespace))
    except REPORTED_ERRORS as err:
        if debug:
            raise
        print(f"relational-hf {name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"relational-hf {name}: interrupted", file=sys.stderr)
        return 130
    return code if isinstance(code, int) else 0


def _logging(name: str, verbose: bool) -> None:
    level = getattr(command_module(name), "LOG_LEVEL", "WARNING")
    logging.basicConfig(level=logging.INFO if verbose else level, format="%(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, run the command; returns the exit status (0 success, 2 usage error or failure reported in one
    line; argparse's own errors also exit 2)."""
    parser = build_parser()
    try:
        namespace = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or an argparse error, already printed with the flag named (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    _logging(namespace.command, namespace.verbose)
    return _execute(namespace.command, namespace, namespace.debug)


def run_command(name: str, argv: list[str] | None = None) -> int:
    """One command parsed on its own (`training_scripts/*.py`): `relational-hf NAME ARGV...` without the prefix."""
    module = command_module(name)
    parser = module.Arguments.argument_parser(
        description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    try:
        namespace = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    _logging(name, False)
    return _execute(name, namespace, namespace.debug)


if __name__ == "__main__":
    sys.exit(main())
