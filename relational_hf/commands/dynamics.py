"""Figures and numbers of recorded training trajectories: raw against quotient motion (DESIGN.md 2.3).

    relational-hf dynamics RUN_DIR [RUN_DIR ...] [--out DIR]

Each RUN_DIR is a training output folder holding `quotient_trajectory.npz` (written by `QuotientTrajectoryCallback`),
a folder with such files below it, or a trajectory file. Writes into --out (default: dynamics): trajectories.png
(a), distance.png (b), vertical_share.png (c), seed_distances.png (d, with two runs of one setting) and
summary.json, and prints one line per run. No model is loaded.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from .checks import output_folder
from .options import CommandArguments, option, positional

HELP = "figures of recorded training trajectories (raw vs quotient motion)"


@dataclass
class DynamicsPaths:
    runs: list[str] = positional(
        "training output folder(s) with quotient_trajectory.npz, folders above them, or files", "RUN_DIR", nargs="+"
    )


@dataclass
class DynamicsOptions:
    _argument_group_name = "output"

    out: str = option("dynamics", "folder for the PNGs and summary.json", metavar="DIR")
    overwrite: bool = option(
        False, "write into an --out folder relational-hf did not write (its files of the figures' names are replaced)"
    )


@dataclass
class DynamicsArguments(CommandArguments, DynamicsOptions, DynamicsPaths):
    POSITIONALS = DynamicsPaths
    PARSER_GROUPS = (DynamicsOptions,)


Arguments = DynamicsArguments


def check(args: DynamicsArguments) -> list:
    """Every RUN_DIR exists and yields readable trajectory files; --out is a folder. Returns the trajectories."""
    from ..dynamics.trajectory import find_trajectories, load_trajectory

    for run_dir in args.runs:
        if not Path(run_dir).exists():
            raise UsageError(f"RUN_DIR {run_dir}: no such file or directory")
    try:
        found = find_trajectories(args.runs)
    except FileNotFoundError as err:
        raise UsageError(f"RUN_DIR: {err}") from None
    trajectories = []
    for path in found:
        try:
            trajectories.append(load_trajectory(path))
        except ValueError as err:
            if str(path) in str(err):  # the loader's own message names the file and what is missing
                raise UsageError(str(err)) from None
            raise UsageError(f"{path}: not a readable trajectory file ({type(err).__name__}: {err})") from None
        except Exception as err:  # a truncated or foreign file: name it, whatever NumPy raised
            raise UsageError(f"{path}: not a readable trajectory file ({type(err).__name__}: {err})") from None
    output_folder(args.out, "--out")
    return trajectories


def _fmt(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.3g}"


#: the files `dynamics` writes into --out
FIGURES = ("trajectories.png", "distance.png", "vertical_share.png", "seed_distances.png", "summary.json")


def run(args: DynamicsArguments) -> int:
    """Write the figures and summary.json of the trajectories into the claimed --out folder (`relational_hf.outputs`:
    a folder of someone else's is refused unless --overwrite), print a line per run (gauge share of the motion, mean
    vertical share of the updates)."""
    from ..dynamics.plots import plot_all, seed_distance_table, setting_name
    from ..outputs import OutputLock, atomic_write_text, check_owned_names, prepare_output_dir, record_files

    trajectories = check(args)
    with OutputLock(args.out):
        out = prepare_output_dir(
            args.out, overwrite=args.overwrite, command="dynamics", kind="figures", flag="--out", swaps=False
        )
        check_owned_names(out, list(FIGURES), overwrite=args.overwrite)
        paths = plot_all(trajectories, out)
        summary = {
            "runs": [dict(t.summary(), file=str(t.path), setting=setting_name(t)) for t in trajectories],
            "seed_distances": seed_distance_table(trajectories),
        }
        summary_path = atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
        record_files(out, [Path(p).name for p in [*paths, summary_path]])
    for run_summary in summary["runs"]:
        share, update = run_summary.get("gauge_share_of_motion"), run_summary.get("mean_update_vertical_share")
        sys.stdout.write(
            f"{run_summary['label']}: {run_summary['records']} records to step {run_summary['last_step']}, gauge "
            f"share of motion {_fmt(share)}, mean vertical share of updates {_fmt(update)}\n"
        )
    for path in [*paths, summary_path]:
        sys.stdout.write(f"wrote {path}\n")
    return 0
