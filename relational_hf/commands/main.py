"""The `relational-hf` command: train | finetune | convert | compress | export | canonicalize | evaluate | redundancy |
analyze | dynamics | push | bench.

Each command is one module of `relational_hf.commands` with the same parts: `HELP` (one line), its docstring (the
description), `Arguments` (its options as a dataclass, `relational_hf.commands.options`) and `run(args)`.

A mistake the user can fix (a flag out of range, a missing, binary or non-UTF-8 file, an output directory that would
be overwritten, a model path that does not exist) ends with one line, ``relational-hf <command>: error: <message>``,
and exit status 2; ``--debug`` shows the traceback instead."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
import time
from types import ModuleType

from ..errors import UsageError, invalid_config_error
from .options import OptionsHelpFormatter

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


#: /proc/loadavg's fourth field, "runnable/total" scheduling entities at this instant (Linux)
PROC_LOADAVG = "/proc/loadavg"


def busy_cores_now(samples: int = 3, interval: float = 0.005) -> float | None:
    """How many threads of other processes are runnable now: the median over `samples` readings of
    /proc/loadavg's runnable count, less this process's reading thread; None where the file cannot be read (not
    Linux). Unlike the 1-minute load average, it does not count a job that ended seconds ago."""
    counts = []
    for i in range(samples):
        try:
            with open(PROC_LOADAVG) as f:
                runnable = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return None
        counts.append(max(0, runnable - 1))
        if i + 1 < samples:
            time.sleep(interval)
    return float(sorted(counts)[len(counts) // 2])


def available_cores() -> int:
    """The cores this process may run on (`os.sched_getaffinity`; `os.cpu_count()` where that cannot be read)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def cpu_threads(ceiling: int | None = None) -> tuple[int, str]:
    """The intra-op thread count for a command's CPU work and why: the cores this process may run on
    (`os.sched_getaffinity`) minus the ones other processes keep busy now (`busy_cores_now`; the 1-minute load
    average where that cannot be read), at least 1 and at most `ceiling` (default: torch's count now);
    `OMP_NUM_THREADS`, when set, decides instead. On a busy machine more threads than idle cores make every parallel
    region wait for a descheduled thread (measured: one training step of the default model took 2.8 s with 2
    threads and 1.0 s with 1 on 2 cores at load 9); the load average, which decays over minutes, made a command
    started right after another job run its whole length on one thread."""
    import torch

    current = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS"):
        return current, "OMP_NUM_THREADS"
    if ceiling is not None:
        current = ceiling
    cores = available_cores()
    busy = busy_cores_now()
    if busy is not None:
        why = f"{cores} core(s) available, {busy:.0f} busy now"
    else:
        try:
            busy = os.getloadavg()[0]
        except (AttributeError, OSError):
            busy = 0.0
        why = f"{cores} core(s) available, load average {busy:.1f}"
    threads = max(1, min(current, cores, int(cores - busy + 0.5)))
    return threads, why


#: torch's own thread count before a command first set it: the most a later re-check gives back
_TORCH_DEFAULT_THREADS: list[int] = []


def set_cpu_threads() -> int:
    """Apply `cpu_threads()` to torch (intra-op threads only) and log it; returns the count."""
    import torch

    if not _TORCH_DEFAULT_THREADS:
        _TORCH_DEFAULT_THREADS.append(torch.get_num_threads())
    threads, why = cpu_threads(_TORCH_DEFAULT_THREADS[0])
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    logging.getLogger(__name__).info("torch uses %d CPU thread(s) (%s)", threads, why)
    return threads


def recheck_cpu_threads(phase: str) -> int:
    """Before a long phase of a command (`phase` names it in the log): the idle cores counted again and applied,
    up to torch's own default, so that a command started while another process was still winding down does not run
    its whole length on the cores idle at that instant (a 40-minute `compress` once ran single-threaded so). Logged
    when the count changes; returns it."""
    import torch

    before = torch.get_num_threads()
    threads, why = cpu_threads(_TORCH_DEFAULT_THREADS[0] if _TORCH_DEFAULT_THREADS else None)
    if threads != before:
        torch.set_num_threads(threads)
        logging.getLogger(__name__).info("%s: torch now uses %d CPU thread(s) (%s)", phase, threads, why)
    return threads


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
        formatter_class=OptionsHelpFormatter,
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


def one_line(err: BaseException) -> str:
    """The message of `err` on one line (a message of several lines, e.g. from torch, joined with "; ")."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return "; ".join(lines) or type(err).__name__


class Terminated(KeyboardInterrupt):
    """SIGTERM during a command: unwinds like Ctrl-C, so a half-written output's staging folder is removed."""


@contextlib.contextmanager
def _terminate_as_interrupt():
    """While a command runs (in the main thread), SIGTERM raises `Terminated` instead of ending the process at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


#: what torchrun and accelerate launch set beside WORLD_SIZE for every process they start
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def check_launcher_environment() -> None:
    """`UsageError` before any work when WORLD_SIZE asks for several processes but the other variables a launcher
    sets are missing (a WORLD_SIZE left in the shell): the run would wait for ever for peers no launcher started."""
    value = os.environ.get("WORLD_SIZE")
    if value is None:
        return
    try:
        size = int(value)
    except ValueError:
        raise UsageError(
            f"the environment variable WORLD_SIZE={value!r} is not a number of processes; unset it"
        ) from None
    missing = [name for name in LAUNCHER_VARIABLES if not os.environ.get(name)]
    if size > 1 and missing:
        raise UsageError(
            f"the environment sets WORLD_SIZE={size} but not {', '.join(missing)}: no launcher started the other "
            "processes, and the run would wait for them for ever. Unset WORLD_SIZE to run in one process, or launch "
            f"with torchrun --nproc_per_node {size} (or accelerate launch --num_processes {size})"
        )


def _execute(name: str, namespace: argparse.Namespace, debug: bool) -> int:
    """Build the command's checked options from `namespace` and run it; user errors in one line (exit 2); Ctrl-C
    (exit 130) and SIGTERM (exit 143) unwind, so that the outputs' staging folders are removed."""
    module = command_module(name)
    set_cpu_threads()
    try:
        check_launcher_environment()
        with _terminate_as_interrupt():
            code = module.run(module.Arguments.from_namespace(namespace))
    except REPORTED_ERRORS as err:
        if debug:
            raise
        print(f"relational-hf {name}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except Exception as err:  # a config Transformers' strict validation refused, wherever it was read
        config_error = invalid_config_error(err)
        if config_error is None or debug:
            raise
        print(f"relational-hf {name}: error: {one_line(config_error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        print(
            f"relational-hf {name}: {'terminated' if isinstance(err, Terminated) else 'interrupted'}", file=sys.stderr
        )
        return 143 if isinstance(err, Terminated) else 130
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
    parser = module.Arguments.argument_parser(description=module.__doc__)
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    try:
        namespace = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    _logging(name, False)
    return _execute(name, namespace, namespace.debug)


if __name__ == "__main__":
    sys.exit(main())
