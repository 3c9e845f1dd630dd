"""Figures of the directional analysis, drawn with matplotlib's object API (no pyplot state, no backend switch)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..outputs.paths import save_figure
from .compression import CompressionReport
from .evaluation import LayerSweepResult, SweepResult
from .statistics import DirectionalReport


def plot_parallel_profile(
    report: DirectionalReport, path: str | os.PathLike, statistic: str = "parallel_ratio", title: str | None = None
) -> None:
    """PNG of one statistic (default mean |y_par|/|y_perp|, log scale) against the layer index, one line per site."""
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.add_subplot()
    for site, layers in report.sites.items():
        ax.plot([s.layer for s in layers], [getattr(s, statistic) for s in layers], marker="o", label=site)
    if statistic == "parallel_ratio":  # heavy-tailed: tokens whose update is nearly along z have huge ratios
        ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(statistic.replace("_", " "))
    ax.set_title(title or f"per-layer {statistic.replace('_', ' ')} by site")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    save_figure(fig, path, dpi=120)


def plot_sweeps(sweeps: Sequence[SweepResult], path: str | os.PathLike, title: str | None = None) -> None:
    """PNG of Delta PPL against the scale s, one panel per component, one line per site (symmetric-log y axis)."""
    components = list(dict.fromkeys(s.component for s in sweeps))
    fig = Figure(figsize=(5.0 * len(components), 4.2), layout="constrained")
    axes = fig.subplots(1, len(components), squeeze=False)[0]
    for ax, component in zip(axes, components):
        for sweep in (s for s in sweeps if s.component == component):
            points = [(v, d) for v, d in zip(sweep.values, sweep.deltas) if math.isfinite(d)]
            if points:
                ax.plot(*zip(*points), marker="o", label=sweep.site)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_yscale("symlog", linthresh=0.1)
        ax.set_xlabel(f"s_{'par' if component == 'parallel' else 'perp'} ({component} scale, other = 1)")
        ax.set_ylabel("Delta PPL")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title or "perplexity change when one component is scaled")
    save_figure(fig, path, dpi=120)


def plot_per_layer(sweeps: Sequence[LayerSweepResult], path: str | os.PathLike, title: str | None = None) -> None:
    """PNG of the per-layer edits: one panel per site, Delta PPL (symmetric-log y) against the edited layer, one line
    per edit (component and scale s); non-finite values are left out of the lines."""
    sites = list(dict.fromkeys(s.site for s in sweeps))
    columns = min(len(sites), 3)
    grid_rows = -(-len(sites) // columns)
    fig = Figure(figsize=(5.0 * columns, 4.0 * grid_rows), layout="constrained")
    axes = fig.subplots(grid_rows, columns, squeeze=False).ravel()
    for ax, site in zip(axes, sites):
        for sweep in (s for s in sweeps if s.site == site):
            for j, value in enumerate(sweep.values):
                points = [(layer, row[j]) for layer, row in zip(sweep.layers, sweep.deltas) if math.isfinite(row[j])]
                symbol = "par" if sweep.component == "parallel" else "perp"
                if points:
                    ax.plot(*zip(*points), marker="o", markersize=3, label=f"s_{symbol} = {value:g}")
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_yscale("symlog", linthresh=0.01)
        ax.set_xlabel("edited layer (all others unedited)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("Delta PPL")
        ax.set_title(site)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes[len(sites) :]:
        ax.set_visible(False)
    tokens = sweeps[0].tokens if sweeps else 0
    fig.suptitle(title or f"perplexity change when one layer is edited ({tokens} tokens)")
    save_figure(fig, path, dpi=120)


def plot_compression(report: CompressionReport, path: str | os.PathLike, title: str | None = None) -> None:
    """PNG with per-layer |e_par|/|delta_dense| and |e_perp|/|delta_dense| for each setting (log y), and the
    compressed perplexity against the mean perpendicular error."""
    fig = Figure(figsize=(13.0, 4.2), layout="constrained")
    ax_par, ax_perp, ax_ppl = fig.subplots(1, 3)
    for result in report.results:
        layers = [e.layer for e in result.layers]
        (line,) = ax_perp.plot(layers, [e.perpendicular for e in result.layers], marker="o", label=result.setting)
        ax_par.plot(layers, [e.parallel for e in result.layers], marker="o", color=line.get_color())
        ax_ppl.scatter(result.mean("perpendicular"), result.perplexity, color=line.get_color())
        ax_ppl.annotate(result.setting, (result.mean("perpendicular"), result.perplexity), fontsize="x-small")
    for ax, name in ((ax_par, "|e_par| / |delta_dense|"), (ax_perp, "|e_perp| / |delta_dense|")):
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    ax_perp.legend(fontsize="x-small")
    rho, _ = report.spearman("perpendicular")
    ax_ppl.axhline(report.dense_perplexity, color="black", linewidth=0.8, linestyle="--", label="dense")
    ax_ppl.set_xscale("log")
    ax_ppl.set_xlabel("mean |e_perp| / |delta_dense|")
    ax_ppl.set_ylabel("perplexity")
    ax_ppl.set_title(f"Spearman rho = {rho:.2f}")
    ax_ppl.grid(alpha=0.3)
    fig.suptitle(title or "layer-local compression error relative to the dense update")
    save_figure(fig, path, dpi=120)
