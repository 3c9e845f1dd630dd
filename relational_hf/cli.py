"""The `relational-hf` command: train | finetune | convert | compress | export | canonicalize | evaluate | redundancy |
analyze | dynamics | push | bench.

A mistake the user can fix (a flag out of range, a missing, binary or non-UTF-8 file, an output directory that would
be overwritten, a model path that does not exist) ends with one line, ``relational-hf <command>: error: <message>``,
and exit status 2; ``--debug`` shows the traceback instead."""

from __future__ import annotations

import argparse
import logging
import sys

from .errors import UsageError
from .validate import existing_dir


def _train(sub: argparse._SubParsersAction) -> None:
    from .training import pretrain

    p = sub.add_parser(
        "train",
        help="train a relational LM (no arguments: built-in corpus, about 3 minutes on CPU)",
        description=pretrain.__doc__,
        parents=[pretrain.train_argument_parser(add_help=False)],  # HfArgumentParser over the option dataclasses
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )

    def run(args):
        result = pretrain.run_train(args)
        print(pretrain.format_result(result, args.architecture))

    p.set_defaults(func=run)


def _push(sub: argparse._SubParsersAction) -> None:
    from .hub import add_push_arguments, run_push

    p = sub.add_parser("push", help="publish a checkpoint with a generated model card to the Hub")
    add_push_arguments(p)
    p.set_defaults(func=run_push, log_level=logging.INFO)


#: The benchmark scripts `relational-hf bench` runs, with the arguments of their quick versions (results in
#: benchmarks/results/<name>_quick.json). A script of the folder that is not listed here is reported, not run.
QUICK_BENCHMARKS: dict[str, tuple[str, ...]] = {
    "compress": ("--quick",),
    "convert": ("--quick",),
    "dynamics": ("--quick",),
    "quality": ("--quick",),
    "speed": ("--quick",),
    "trainer_overhead": ("--quick",),
}


def _bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run the quick versions of the benchmarks in benchmarks/ (a source checkout)")
    p.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {', '.join(QUICK_BENCHMARKS)})")
    p.add_argument(
        "--dir", type=existing_dir, default=None, help="the benchmarks folder (default: ./benchmarks or the checkout's)"
    )
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    import subprocess
    from pathlib import Path

    candidates = (
        [Path(args.dir)]
        if args.dir
        else [Path.cwd() / "benchmarks", Path(__file__).resolve().parents[1] / "benchmarks"]
    )
    folder = next((c for c in candidates if (c / "common.py").is_file()), None)
    if folder is None:
        raise UsageError("no benchmarks folder found (run from a source checkout or pass --dir)")
    unknown = sorted(set(args.names) - set(QUICK_BENCHMARKS))
    if unknown:
        raise UsageError(f"unknown benchmark(s) {unknown}; available: {sorted(QUICK_BENCHMARKS)}")
    names = args.names or list(QUICK_BENCHMARKS)
    absent = [name for name in names if not (folder / f"{name}.py").is_file()]
    if absent:
        raise UsageError(f"benchmark script(s) {absent} not found in {folder}")
    unlisted = sorted(p.stem for p in folder.glob("*.py") if p.stem not in QUICK_BENCHMARKS and p.stem != "common")
    if unlisted and not args.names:
        print(f"not run (no quick version listed): {', '.join(unlisted)}", flush=True)
    scripts = [(folder / f"{name}.py", QUICK_BENCHMARKS[name]) for name in names]
    failed = []
    for script, flags in scripts:
        print(f"== {script.stem} {' '.join(flags)}", flush=True)
        if subprocess.run([sys.executable, script.name, *flags], cwd=folder).returncode != 0:
            failed.append(script.stem)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _convert(sub: argparse._SubParsersAction) -> None:
    from .convert import add_convert_arguments, run_convert

    p = sub.add_parser(
        "convert", help="convert a Llama/Mistral/Qwen2 checkpoint into a relational one (exact, or sliced)"
    )
    add_convert_arguments(p)
    p.set_defaults(func=run_convert, log_level=logging.INFO)


def _export(sub: argparse._SubParsersAction) -> None:
    from .convert import export

    p = sub.add_parser(
        "export",
        help="write a relational checkpoint as a plain Llama checkpoint (no plugin needed to load it)",
        description=export.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_export_arguments(p)
    p.set_defaults(func=export.run_export, log_level=logging.INFO)


def _compress(sub: argparse._SubParsersAction) -> None:
    from .compress import cli as compress_cli

    p = sub.add_parser(
        "compress",
        help="compress a checkpoint in relational coordinates (--remove share of stored parameters)",
        description=compress_cli.__doc__,
    )
    compress_cli.add_compress_arguments(p)
    p.set_defaults(func=compress_cli.run_compress, log_level=logging.INFO)


def _canonicalize(sub: argparse._SubParsersAction) -> None:
    from .symmetry import canonical_cli

    p = sub.add_parser(
        "canonicalize",
        help="move a checkpoint to the canonical point of its symmetry orbit (same function; streamed layer by layer)",
        description=canonical_cli.__doc__,
    )
    canonical_cli.add_canonicalize_arguments(p)
    p.set_defaults(func=canonical_cli.run_canonicalize, log_level=logging.INFO)


def _evaluate(sub: argparse._SubParsersAction) -> None:
    from .lm import evaluate_cli

    p = sub.add_parser(
        "evaluate",
        help="perplexity of a model on a text, with disk offload for models that do not fit in memory",
        description=evaluate_cli.__doc__,
    )
    evaluate_cli.add_evaluate_arguments(p)
    p.set_defaults(func=evaluate_cli.run_evaluate)


def _redundancy(sub: argparse._SubParsersAction) -> None:
    from .symmetry import add_redundancy_arguments, run_redundancy

    p = sub.add_parser("redundancy", help="count a model's continuous symmetries and its invariant descriptors")
    add_redundancy_arguments(p)
    p.set_defaults(func=run_redundancy)


def _analyze(sub: argparse._SubParsersAction) -> None:
    from .directional import analyze

    p = sub.add_parser(
        "analyze",
        help="update geometry, component sweeps and compression diagnostics of a model",
        description=analyze.__doc__,
    )
    analyze.add_analyze_arguments(p)
    p.set_defaults(func=analyze.run_analyze)


def _finetune(sub: argparse._SubParsersAction) -> None:
    from .training import finetune

    p = sub.add_parser(
        "finetune",
        help="fine-tune a checkpoint (full or LoRA) with projection / parallel suppression",
        description=finetune.__doc__,
        parents=[finetune.finetune_argument_parser(add_help=False)],  # HfArgumentParser over the option dataclasses
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )

    def run(args):
        result = finetune.run_finetune(args)
        if result.main_process:
            print(finetune.format_finetune_result(result))

    p.set_defaults(func=run)


def _dynamics(sub: argparse._SubParsersAction) -> None:
    from .dynamics import add_dynamics_arguments, cli, run_dynamics

    p = sub.add_parser(
        "dynamics", help="figures of recorded training trajectories (raw vs quotient motion)", description=cli.__doc__
    )
    add_dynamics_arguments(p)
    p.set_defaults(func=run_dynamics)


COMMANDS = [
    _train,
    _finetune,
    _convert,
    _compress,
    _export,
    _canonicalize,
    _evaluate,
    _redundancy,
    _analyze,
    _dynamics,
    _push,
    _bench,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relational-hf",
        description=__doc__.split("\n\n")[0],
        epilog="Run `relational-hf COMMAND --help` for the flags of a command.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


# Errors a user can cause and fix: reported in one line. Anything else is a bug and keeps its traceback.
USER_ERRORS = (UsageError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
REPORTED_ERRORS = (*USER_ERRORS, RuntimeError, OSError)


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, run the command; returns the exit status (0 success, 2 usage error or failure reported in one
    line; argparse's own errors also exit 2)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or an argparse error, already printed with the flag named (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    level = logging.INFO if args.verbose else getattr(args, "log_level", logging.WARNING)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        code = args.func(args)
    except REPORTED_ERRORS as err:
        if args.debug:
            raise
        print(f"relational-hf {args.command}: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # a command that stops with a message (SystemExit("...")): same one-line form
        if isinstance(exit_.code, str):
            print(f"relational-hf {args.command}: error: {exit_.code}", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        print(f"relational-hf {args.command}: interrupted", file=sys.stderr)
        return 130
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
