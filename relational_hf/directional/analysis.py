"""The directional analysis of a causal LM on token rows (DESIGN.md section 3), as `relational-hf analyze` runs it.

`directional_analysis` measures, in this order (each step saved through `save` as it completes, so an interrupted run
keeps what it measured): the unedited pass (`CleanPass`), the per-layer parallel/perpendicular statistics of every
site, the all-layer edits (a component scaled at one site in every layer at once) and the diagonal control, the
per-layer edits (one layer at a time, on the first rows) and the compression errors. The report is a JSON-ready dict;
`format_table` / `format_markdown` lay it out.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .compression import CompressionReport, compression_report
from .decompose import decompose_dataset
from .edits import scale_components
from .evaluation import COMPONENTS, sweep_all, sweep_per_layer
from .plots import plot_compression, plot_parallel_profile, plot_per_layer, plot_sweeps
from .replay import CleanPass
from .tables import finite_or_none, format_number, markdown_table


def directional_analysis(
    model: nn.Module,
    rows: torch.Tensor,
    *,
    out: str | Path,
    sites: list[str],
    sweep_values: list[float],
    per_layer_sites: list[str],
    per_layer_edits: list[tuple[str, list[float]]],
    per_layer_tokens: int,
    compression: list[str],
    calibration: torch.Tensor,
    group_size: int = 128,
    batch_size: int = 8,
    save: Callable[[dict, CompressionReport | None], None] | None = None,
    description: dict | None = None,
) -> tuple[dict, CompressionReport | None]:
    """Analyse `model` on the token `rows` (n, T) and draw the figures into the folder `out` (module docstring).

    `per_layer_edits`: [(component, scales)], skipped when every list is empty; `compression`: settings of
    `compression_report` (calibrated on `calibration`), skipped when empty. `save(report, compression)` is called after
    each stage; `description` adds entries at the top of the report (model, text). Returns (report, compression)."""
    out = Path(out)
    seq_len = rows.shape[1]
    batches = [rows[i : i + batch_size] for i in range(0, rows.shape[0], batch_size)]
    timings: dict[str, float] = {}
    clock = [time.perf_counter()]

    def lap(stage: str) -> None:
        now = time.perf_counter()
        timings[stage] = round(now - clock[0], 3)
        clock[0] = now

    def checkpoint(comp: CompressionReport | None = None) -> None:
        if save is not None:
            save(report, comp)

    clean = CleanPass(model, rows, None, batch_size, progress=True, desc="clean pass")
    lap("clean_pass")
    decomposition = decompose_dataset(model, batches, sites=sites, total=len(batches))
    lap("decomposition")
    sweeps = sweep_all(model, rows, sites, COMPONENTS, sweep_values, batch_size=batch_size, clean=clean)
    with scale_components(model, "diagonal"):
        diagonal = clean.perplexity(progress=True, desc="diagonal control")
    lap("all_layer_edits")
    figures = {"parallel_profile": str(out / "parallel_ratio.png"), "sweeps": str(out / "sweep.png")}
    plot_parallel_profile(decomposition, figures["parallel_profile"])
    plot_sweeps(sweeps, figures["sweeps"])
    report = {
        **(description or {}),
        "tokens_analysed": int(rows.numel()),
        "seq_len": seq_len,
        "perplexity": clean.baseline,
        "decomposition": decomposition.to_dict(),
        "sweeps": [s.to_dict() for s in sweeps],
        "diagonal_removal": {
            "perplexity": finite_or_none(diagonal),
            "delta": finite_or_none(diagonal - clean.baseline),
        },
        "figures": figures,
        "timings_s": timings,
        "complete": False,
    }
    checkpoint()  # partial results survive an interrupted run
    if any(values for _, values in per_layer_edits):
        n_rows = max(1, min(rows.shape[0], math.ceil(per_layer_tokens / seq_len)))
        layer_sweeps = sweep_per_layer(
            model, rows, per_layer_sites, per_layer_edits, batch_size=batch_size, clean=clean, rows=n_rows
        )
        lap("per_layer_edits")
        figures["per_layer"] = str(out / "per_layer.png")
        plot_per_layer(layer_sweeps, figures["per_layer"])
        report["per_layer"] = [s.to_dict() for s in layer_sweeps]
        checkpoint()
    comp = None
    if compression:
        comp = compression_report(
            model,
            rows,
            compression,
            calibration_ids=calibration,
            group_size=group_size,
            batch_size=batch_size,
            clean=clean,
        )
        lap("compression")
        figures["compression"] = str(out / "compression.png")
        plot_compression(comp, figures["compression"])
        report["compression"] = comp.to_dict()
    report["complete"] = True
    checkpoint(comp)
    return report, comp


def _edit_label(component: str, value: float) -> str:
    return f"s_{'par' if component == 'parallel' else 'perp'}={value:g}"


def all_layer_table(report: dict) -> str:
    """Per site: mean and last-layer |y_par|/|y_perp| and Delta PPL of every all-layer edit swept."""
    sweeps = {(s["site"], s["component"]): s for s in report["sweeps"]}
    edits = [(c, v) for c in COMPONENTS for v in report["sweeps"][0]["values"] if v != 1.0] if sweeps else []
    header = ["site", "mean ratio", "last layer", *(f"dPPL {_edit_label(c, v)}" for c, v in edits)]
    rows = []
    for site, layers in report["decomposition"].items():
        ratios = [layer["parallel_ratio"] for layer in layers]
        cells = [site, format_number(sum(ratios) / len(ratios)), format_number(ratios[-1])]
        for component, value in edits:
            sweep = sweeps.get((site, component))
            delta = None if sweep is None else sweep["deltas"][sweep["values"].index(value)]
            cells.append(format_number(delta, signed=True))
        rows.append(cells)
    return markdown_table(header, rows)


def _per_layer_columns(per_layer: list[dict]) -> list[tuple[str, str, float, list[float | None], list[int]]]:
    return [
        (s["site"], s["component"], v, [row[j] for row in s["deltas"]], s["layers"])
        for s in per_layer
        for j, v in enumerate(s["values"])
    ]


def per_layer_summary_table(per_layer: list[dict]) -> str:
    """Per site and per-layer edit: the smallest, median and largest Delta PPL over the layers (and where)."""
    rows = []
    for site, component, value, deltas, layers in _per_layer_columns(per_layer):
        finite = [(d, layer) for d, layer in zip(deltas, layers) if d is not None]
        if not finite:
            rows.append([site, _edit_label(component, value), "inf", "inf", "inf"])
            continue
        low, high = min(finite), max(finite)
        rows.append(
            [
                site,
                _edit_label(component, value),
                f"{format_number(low[0], True)} (L{low[1]})",
                format_number(statistics.median(d for d, _ in finite), True),
                f"{format_number(high[0], True)} (L{high[1]})" if len(finite) == len(deltas) else "inf",
            ]
        )
    return markdown_table(["site", "one layer edited", "min dPPL", "median dPPL", "max dPPL"], rows)


def per_layer_table(per_layer: list[dict]) -> str:
    """Delta PPL of every per-layer edit: one row per layer, one column per (site, edit)."""
    columns = _per_layer_columns(per_layer)
    layers = columns[0][4]
    header = ["layer", *(f"{site} {_edit_label(c, v)}" for site, c, v, _, _ in columns)]
    rows = [[str(layer), *(format_number(col[3][i], True) for col in columns)] for i, layer in enumerate(layers)]
    return markdown_table(header, rows)


def _protocol_lines(report: dict) -> list[str]:
    lines = [f"perplexity {report['perplexity']:.3f} on {report['tokens_analysed']} tokens", ""]
    lines += ["All-layer edits (the component scaled in every layer at once):", "", all_layer_table(report)]
    lines.append(
        f"\ndiagonal removal (A_tt = 0, all layers): dPPL {format_number(report['diagonal_removal']['delta'], True)}"
    )
    if report.get("per_layer"):
        first = report["per_layer"][0]
        lines += [
            "",
            f"Per-layer edits (one layer at a time; {first['tokens']} predicted tokens of the first {first['rows']} "
            f"rows, unedited perplexity {first['baseline']:.3f}):",
            "",
            per_layer_summary_table(report["per_layer"]),
        ]
    return lines


def format_table(report: dict, compression: CompressionReport | None = None) -> str:
    """The printed summary: the all-layer table (per site the mean and last-layer |y_par|/|y_perp| and Delta PPL
    of every swept edit), the diagonal control, the per-layer summary and the compression ranking when there is one."""
    lines = _protocol_lines(report)
    if compression is not None:
        lines += ["", compression.to_markdown()]
    return "\n".join(lines)


def format_markdown(report: dict, compression: CompressionReport | None = None) -> str:
    """`report.md`: the printed summary plus the full per-layer table."""
    lines = [f"# Directional analysis of {report['model']}", "", *_protocol_lines(report)]
    if report.get("per_layer"):
        lines += ["", "Delta PPL with one layer edited:", "", per_layer_table(report["per_layer"])]
    if compression is not None:
        lines += ["", "## Compression", "", compression.to_markdown()]
    return "\n".join(lines)


__all__ = [
    "all_layer_table",
    "directional_analysis",
    "format_markdown",
    "format_table",
    "per_layer_summary_table",
    "per_layer_table",
]
