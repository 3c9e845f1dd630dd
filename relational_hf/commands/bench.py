"""Run the quick versions of the benchmarks in a source checkout's `benchmarks/` folder.

    relational-hf bench [NAME ...] [--dir DIR]

Each benchmark script writes `benchmarks/results/<name>_quick.json` (and its PNG); the full runs and their options
are described in each script's docstring and in the README.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from .checks import existing_folder
from .options import CommandArguments, option, positional

HELP = "run the quick versions of the benchmarks in benchmarks/ (a source checkout)"

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


@dataclass
class BenchNames:
    names: list[str] = positional(
        f"benchmarks to run (default: all of {', '.join(QUICK_BENCHMARKS)})", "NAME", nargs="*"
    )


@dataclass
class BenchOptions:
    _argument_group_name = "benchmarks"

    dir: str | None = option(None, "the benchmarks folder (default: ./benchmarks or the checkout's)", metavar="DIR")


@dataclass
class BenchArguments(CommandArguments, BenchOptions, BenchNames):
    POSITIONALS = BenchNames
    PARSER_GROUPS = (BenchOptions,)


Arguments = BenchArguments


def _folder(args: BenchArguments) -> Path:
    if args.dir:
        return existing_folder(args.dir, "--dir")
    candidates = [Path.cwd() / "benchmarks", Path(__file__).resolve().parents[2] / "benchmarks"]
    folder = next((c for c in candidates if (c / "common.py").is_file()), None)
    if folder is None:
        raise UsageError("no benchmarks folder found (run from a source checkout or pass --dir)")
    return folder


def run(args: BenchArguments) -> int:
    folder = _folder(args)
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
    failed = []
    for name in names:
        flags = QUICK_BENCHMARKS[name]
        print(f"== {name} {' '.join(flags)}", flush=True)
        if subprocess.run([sys.executable, f"{name}.py", *flags], cwd=folder).returncode != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
