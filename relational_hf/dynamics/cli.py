"""`relational-hf dynamics RUN_DIR [RUN_DIR ...] [--out DIR]`: figures and numbers of recorded trajectories.

Each RUN_DIR is a training output folder holding `quotient_trajectory.npz` (written by `QuotientTrajectoryCallback`),
a folder with such files below it, or a trajectory file. Writes into --out (default: dynamics): trajectories.png
(a), distance.png (b), vertical_share.png (c), seed_distances.png (d, with two runs of one setting) and
summary.json, and prints one line per run. No model is loaded.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ..validate import check_dynamics_args
from .plots import plot_all, seed_distance_table, setting_name
from .trajectory import find_trajectories, load_trajectory


def add_dynamics_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `dynamics` command's arguments to `parser`."""
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR",
        help="training output folder(s) with quotient_trajectory.npz, folders above them, or files",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("dynamics"),
        metavar="DIR",
        help="folder for the PNGs and summary.json (default: dynamics)",
    )
    return parser  # fmt: skip


def run_dynamics(args: argparse.Namespace) -> int:
    """Load the trajectories of `args.runs`, write the figures and summary.json into `args.out`, print a line per
    run (gauge share of the motion, mean vertical share of the updates). Returns the exit code."""
    check_dynamics_args(args)
    trajectories = [load_trajectory(p) for p in find_trajectories(args.runs)]
    paths = plot_all(trajectories, args.out)
    summary = {
        "runs": [dict(t.summary(), file=str(t.path), setting=setting_name(t)) for t in trajectories],
        "seed_distances": seed_distance_table(trajectories),
    }
    summary_path = Path(args.out) / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2))
    for run in summary["runs"]:
        share, update = run.get("gauge_share_of_motion"), run.get("mean_update_vertical_share")
        sys.stdout.write(
            f"{run['label']}: {run['records']} records to step {run['last_step']}, gauge share of motion "
            f"{_fmt(share)}, mean vertical share of updates {_fmt(update)}\n"
        )
    for path in [*paths, summary_path]:
        sys.stdout.write(f"wrote {path}\n")
    return 0


def _fmt(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.3g}"


__all__ = ["add_dynamics_arguments", "run_dynamics"]
