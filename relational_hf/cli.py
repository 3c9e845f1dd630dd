"""The `relational-hf` command: train | convert | compress | redundancy | analyze | push | bench."""

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


def _bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run the quick versions of the benchmarks in benchmarks/ (a source checkout)")
    p.add_argument("names", nargs="*", help="benchmarks to run (default: every benchmarks/*.py with a --quick flag)")
    p.add_argument("--dir", default=None, help="the benchmarks folder (default: ./benchmarks or the checkout's)")
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
        raise FileNotFoundError("no benchmarks folder found (run from a source checkout or pass --dir)")
    scripts = sorted(p for p in folder.glob("*.py") if p.name != "common.py" and "--quick" in p.read_text())
    if args.names:
        scripts = [s for s in scripts if s.stem in args.names]
        missing = set(args.names) - {s.stem for s in scripts}
        if missing:
            raise ValueError(
                f"unknown benchmark(s) {sorted(missing)}; available: {sorted(p.stem for p in folder.glob('*.py'))}"
            )
    failed = []
    for script in scripts:
        print(f"== {script.stem} --quick", flush=True)
        if subprocess.run([sys.executable, script.name, "--quick"], cwd=folder).returncode != 0:
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


def _compress(sub: argparse._SubParsersAction) -> None:
    from .compress import cli as compress_cli

    p = sub.add_parser(
        "compress",
        help="compress a checkpoint in relational coordinates (--remove share of stored parameters)",
        description=compress_cli.__doc__,
    )
    compress_cli.add_compress_arguments(p)
    p.set_defaults(func=compress_cli.run_compress, log_level=logging.INFO)


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
    )
    finetune.add_finetune_arguments(p)

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


COMMANDS = [_train, _finetune, _convert, _compress, _redundancy, _analyze, _dynamics, _push, _bench]


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
