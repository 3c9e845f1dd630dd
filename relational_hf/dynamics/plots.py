"""Figures of recorded trajectories, drawn with matplotlib's object API (no pyplot state, no backend switch).

(a) `plot_trajectories`: each run's path in the first two principal components of the raw-parameter sketch, of the
    canonical-gauge sketch and of the invariant descriptors, PCA shared by the runs of one architecture;
(b) `plot_distance_travelled`: cumulative distance in raw parameters vs along the quotient, and the gauge share;
(c) `plot_vertical_share`: |P_V delta| / |delta| of the recorded updates (and gradients) over training;
(d) `plot_seed_distances`: distances between the final models of runs of one group (e.g. seeds of one setting) in
    raw coordinates, after canonicalisation, and in the descriptors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from ..outputs.paths import save_figure
from .trajectory import Trajectory, comparable, descriptor_vector, final_distances

logger = logging.getLogger(__name__)

#: |P_V x| / |x| below this is drawn at this floor on log axes (exact zeros: groups with nothing to project)
SHARE_FLOOR = 1e-12


def _pca(blocks: Sequence[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray]:
    """Project each (n_i, k) block onto the first two principal components of all rows together; returns the
    projected blocks and the explained-variance ratios of the two components."""
    stacked = np.concatenate([b.astype(np.float64) for b in blocks])
    mean = stacked.mean(0)
    _, s, vt = np.linalg.svd(stacked - mean, full_matrices=False)
    components = vt[:2] if vt.shape[0] >= 2 else np.vstack([vt, np.zeros_like(vt)])[:2]
    variance = s**2
    ratio = variance[:2] / variance.sum() if variance.sum() > 0 else np.zeros(2)
    return [(b.astype(np.float64) - mean) @ components.T for b in blocks], np.pad(ratio, (0, 2 - ratio.size))


def _style(t: Trajectory) -> dict:
    return {"linestyle": "--" if t.metadata.get("projection") else "-"}


def plot_trajectories(trajectories: Sequence[Trajectory], path: str | os.PathLike) -> Path:
    """(a) PNG: for every set of comparable runs (same parameter shapes and sketch) one row of three panels, the
    runs' paths in the first two principal components (shared by the runs of the row) of the raw sketch S theta, the
    canonical sketch S c(theta), and the invariant descriptors (spectra and head similarities). Circles mark the
    first record, squares the last; dashed lines are runs with projected updates."""
    groups = comparable(trajectories)
    kinds = [("raw_sketch", "raw parameters (sketch)"), ("canonical_sketch", "canonical gauge (sketch)"),
             ("descriptors", "descriptors: spectra + head similarity")]  # fmt: skip
    fig = Figure(figsize=(15, 4.4 * len(groups)), layout="constrained")
    axes = fig.subplots(len(groups), 3, squeeze=False)
    for row, group in zip(axes, groups):
        for ax, (key, title) in zip(row, kinds):
            runs = [t for t in group if key in t or (key == "descriptors" and "qk_spectrum" in t)]
            if not runs:
                ax.set_axis_off()
                continue
            if key == "descriptors":
                blocks = [np.stack([descriptor_vector(t.coordinates(i)) for i in range(t.steps.size)]) for t in runs]
            else:
                blocks = [t[key] for t in runs]
            projected, ratio = _pca(blocks)
            for t, xy in zip(runs, projected):
                line = ax.plot(xy[:, 0], xy[:, 1], marker=".", ms=3, lw=1.2, label=t.label, **_style(t))[0]
                ax.plot(*xy[0, :2], "o", color=line.get_color(), ms=6)
                ax.plot(*xy[-1, :2], "s", color=line.get_color(), ms=6)
            ax.set_xlabel(f"PC1 ({100 * ratio[0]:.0f}% of variance)")
            ax.set_ylabel(f"PC2 ({100 * ratio[1]:.0f}%)")
            ax.set_title(title, fontsize=10)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
    fig.suptitle("(a) trajectories, PCA shared by the runs of each row (o first record, [] last)")
    save_figure(fig, path, dpi=110)
    return Path(path)


def plot_distance_travelled(trajectories: Sequence[Trajectory], path: str | os.PathLike) -> Path:
    """(b) PNG: left, the cumulative distance travelled (chords between records) in raw parameters sum |Delta|
    (solid) and along the quotient sum |Delta - P_V Delta| (dotted), the legend giving each run's gauge share of the
    squared motion sum |P_V Delta|^2 / sum |Delta|^2; middle, the vertical (gauge) share |P_V Delta| / |Delta| of
    every chord; right, the chords in canonical coordinates sum |c(theta_i) - c(theta_i-1)| against the raw ones
    (log scale: the canonical representative can jump where the canonical gauge is ill-conditioned, e.g. near
    degenerate spectra or a change of pivots)."""
    fig = Figure(figsize=(18, 4.8), layout="constrained")
    left, middle, right = fig.subplots(1, 3)
    for t in trajectories:
        lengths = t.path_lengths()
        share = t.gauge_share()
        line = left.plot(t.steps, lengths["raw"], lw=1.6, label=f"{t.label} (gauge share {share:.3g})")[0]
        color = line.get_color()
        left.plot(t.steps, lengths["horizontal"], ":", color=color, lw=1.6)
        middle.plot(t.steps, np.maximum(t.vertical_share("interval"), SHARE_FLOOR), marker=".", color=color,
                    label=t.label, **_style(t))  # fmt: skip
        right.plot(t.steps, lengths["raw"], color=color, lw=1.2)
        if "canonical" in lengths:
            right.plot(t.steps, lengths["canonical"], "-.", color=color, lw=1.2)
    left.set_xlabel("optimiser step")
    left.set_ylabel("cumulative distance (chords between records)")
    left.set_title("raw parameters (solid) vs along the quotient (dotted)", fontsize=10)
    left.legend(fontsize=7)
    left.grid(alpha=0.3)
    middle.set_yscale("log")
    middle.set_xlabel("optimiser step")
    middle.set_ylabel("|P_V Delta| / |Delta| of the chord since the previous record")
    middle.set_title("gauge share of each chord", fontsize=10)
    middle.grid(alpha=0.3)
    right.set_yscale("log")
    right.set_xlabel("optimiser step")
    right.set_ylabel("cumulative distance")
    right.set_title("raw (solid) vs canonical-coordinate chords (dash-dot)", fontsize=10)
    right.grid(alpha=0.3)
    fig.suptitle("(b) distance travelled in raw parameters vs along the quotient")
    save_figure(fig, path, dpi=110)
    return Path(path)


def plot_vertical_share(trajectories: Sequence[Trajectory], path: str | os.PathLike) -> Path:
    """(c) PNG: the vertical share |P_V delta| / |delta| of each recorded optimiser update (left) and |P_V g| / |g| of
    its gradient (right) against the step, log scale; dashed lines are runs with projected updates. Exact zeros
    (no group left to project, e.g. a pivot-gauge model) are drawn at SHARE_FLOOR."""
    fig = Figure(figsize=(13, 4.6), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, kind, title in zip(axes, ("update", "gradient"), ("optimiser update delta", "gradient g")):
        for t in trajectories:
            tag = " (projected)" if t.metadata.get("projection") else ""
            share = np.maximum(t.vertical_share(kind), SHARE_FLOOR)
            ax.plot(t.steps, share, marker=".", label=t.label + tag, **_style(t))
        ax.set_yscale("log")
        ax.set_xlabel("optimiser step")
        ax.set_ylabel(f"|P_V x| / |x|, x = {title}")
        ax.grid(alpha=0.3)
        ax.set_title(f"vertical share of the {title}", fontsize=10)
    axes[0].legend(fontsize=7)
    fig.suptitle("(c) vertical vs horizontal: share of each recorded step along the symmetry orbits")
    save_figure(fig, path, dpi=110)
    return Path(path)


def setting_name(t: Trajectory) -> str:
    """The training setting a run belongs to: metadata "group" when given, else model class, gauge and whether the
    updates were projected (runs that differ only in their seed share it)."""
    if t.metadata.get("group"):
        return str(t.metadata["group"])
    gauge = (t.metadata.get("config") or {}).get("gauge")
    parts = [t.metadata.get("model_class", "model"), f"{gauge} gauge" if gauge else None,
             "projected" if t.metadata.get("projection") else None]  # fmt: skip
    return ", ".join(p for p in parts if p)


def seed_groups(trajectories: Sequence[Trajectory]) -> dict[str, list[Trajectory]]:
    """Runs grouped by `setting_name` (e.g. one training setting run with several seeds)."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(setting_name(t), []).append(t)
    return groups


def seed_distance_table(trajectories: Sequence[Trajectory]) -> dict[str, dict[str, dict[str, float]]]:
    """{group: {distance kind: {"mean", "min", "max", "pairs"}}} over the pairs of runs inside each group of
    `seed_groups` (kinds of `trajectory.coordinate_distances`, between final records); groups of one run are left
    out."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for name, runs in seed_groups(trajectories).items():
        if len(runs) < 2:
            continue
        mask = ~np.eye(len(runs), dtype=bool)
        for kind, matrix in final_distances(runs).items():
            values = matrix[np.triu(mask)]
            values = values[np.isfinite(values)]
            if values.size:
                table.setdefault(name, {})[kind] = {"mean": float(values.mean()), "min": float(values.min()),
                                                    "max": float(values.max()), "pairs": int(values.size)}  # fmt: skip
    return table


def plot_seed_distances(trajectories: Sequence[Trajectory], path: str | os.PathLike) -> Path | None:
    """(d) PNG: per group of runs (`seed_groups`), the relative distance between final models, mean over pairs with
    min-max bars, in raw parameters, in canonical-gauge parameters, in the descriptors, and in the descriptors with
    heads sorted (blind to head permutations). None (nothing written) when no group has two runs."""
    table = seed_distance_table(trajectories)
    if not table:
        logger.info("(d) needs two runs of one group: seed distances not drawn")
        return None
    kinds = ["raw", "canonical", "descriptors", "descriptors_sorted_heads"]
    fig = Figure(figsize=(max(6.4, 2.2 * len(table) + 2), 4.6), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(kinds)
    x = np.arange(len(table))
    for i, kind in enumerate(kinds):
        stats = [table[g].get(kind) for g in table]
        mean = np.array([s["mean"] if s else np.nan for s in stats])
        low = np.array([s["mean"] - s["min"] if s else 0.0 for s in stats])
        high = np.array([s["max"] - s["mean"] if s else 0.0 for s in stats])
        ax.bar(x + (i - 1.5) * width, mean, width, yerr=[low, high], capsize=3, label=kind.replace("_", " "))
    ax.set_xticks(x, list(table), fontsize=8)
    ax.set_ylabel("relative distance |a - b| / rms(|a|, |b|)")
    ax.set_title("(d) distance between final models of one group: raw vs canonicalised vs invariants", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path, dpi=110)
    return Path(path)


def plot_all(trajectories: Sequence[Trajectory], out_dir: str | os.PathLike) -> list[Path]:
    """Write the four figures into `out_dir` (trajectories.png, distance.png, vertical_share.png and, with two runs
    of one group, seed_distances.png); returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        plot_trajectories(trajectories, out / "trajectories.png"),
        plot_distance_travelled(trajectories, out / "distance.png"),
        plot_vertical_share(trajectories, out / "vertical_share.png"),
    ]
    seeds = plot_seed_distances(trajectories, out / "seed_distances.png")
    return paths + ([seeds] if seeds is not None else [])


__all__ = [
    "SHARE_FLOOR",
    "plot_all",
    "plot_distance_travelled",
    "plot_seed_distances",
    "plot_trajectories",
    "plot_vertical_share",
    "seed_distance_table",
    "seed_groups",
    "setting_name",
]
