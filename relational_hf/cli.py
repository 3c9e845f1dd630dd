"""The `relational-hf` command: train | convert | redundancy | analyze | push | bench."""

from __future__ import annotations

import argparse
import logging
import sys


def _train(sub: argparse._SubParsersAction) -> None:
    from .training import pretrain

    p = sub.add_parser(
        "train",
        help="train a relational LM (no arguments: built-in corpus, about 3 minutes on CPU)",
        description=pretrain.__doc__,
    )
    pretrain.add_train_arguments(p)

    def run(args):
        result = pretrain.run_train(args)
        print(pretrain.format_result(result, args.architecture))

    p.set_defaults(func=run)


def _push(sub: argparse._SubParsersAction) -> None:
    from .hub import add_push_arguments, run_push

    p = sub.add_parser("push", help="publish a checkpoint with a generated model card to the Hub")
    add_push_arguments(p)
    p.set_defaults(func=run_push, log_level=logging.INFO)


COMMANDS = [_train, _push]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relational-hf", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.INFO if args.verbose else getattr(args, "log_level", logging.WARNING)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        code = args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as err:
        print(f"relational-hf {args.command}: error: {err}", file=sys.stderr)
        return 2
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
