"""`relational-hf analyze MODEL_OR_DIR --text FILE`: the directional analysis of a causal LM on a text file.

Writes `report.json`, `report.md` (the tables) and PNG figures to --out: the per-layer parallel ratio by site, the
Delta PPL of the all-layer sweeps, the per-layer edits (one layer at a time) and the compression errors; prints the
summary tables. The text is cut into rows of --seq-len tokens (at most --max-tokens); the first
--calibration-fraction of the rows calibrate Wanda, the rest are analysed.

Two edit protocols (DESIGN.md section 3): all-layer edits scale a component at one site in every layer at once
(--sweep-values); per-layer edits scale it in one layer at a time (--per-layer-*), on the first --per-layer-tokens
analysed tokens. The unedited pass is computed once; a per-layer edit of layer l reruns only layers l..L-1 from
the recorded input of layer l.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path

import torch

from ..lm.data import lm_blocks as token_blocks
from ..loading import add_model_source_arguments
from ..validate import (
    check_analyze_args,
    finite_float,
    fraction_closed_open,
    int_at_least,
    nonnegative_int,
    positive_int,
    text_file,
)
from .compression import COMPRESSION_SETTINGS, CompressionReport, compression_report, settings_from
from .decompose import decompose_dataset
from .edits import scale_components
from .evaluation import COMPONENTS, sweep_all, sweep_per_layer
from .plots import plot_compression, plot_parallel_profile, plot_per_layer, plot_sweeps
from .replay import CleanPass
from .sites import SITES
from .tables import finite_or_none, format_number, markdown_table

logger = logging.getLogger(__name__)

DEFAULT_SWEEP = (0.0, 0.5)
DEFAULT_PER_LAYER_SITES = ("residual_attention", "residual_mlp", "value_exclude_self")
DEFAULT_PER_LAYER_PARALLEL = (0.0, 0.5)
DEFAULT_PER_LAYER_PERPENDICULAR = (0.0,)
#: the word that skips a list option (--compression none, --per-layer-perpendicular none)
NONE = "none"


def _floats_or_none(name: str, values: list[str]) -> list[float]:
    """Parse a list option of scales where the single word "none" means the empty list."""
    if [v.lower() for v in values] == [NONE]:
        return []
    out = []
    for v in values:
        try:
            out.append(float(v))
        except ValueError:
            raise ValueError(f"{name} takes numbers or the single word 'none', got {v!r}") from None
    return out


def compression_settings(names: list[str] | None) -> list[str]:
    """The settings of --compression: "none" (alone) or nothing skips compression; other names are validated."""
    names = list(names or [])
    if any(n.lower() == NONE for n in names):
        if len(names) > 1:
            raise ValueError(f"--compression: 'none' cannot be combined with settings, got {' '.join(names)}")
        return []
    return settings_from(names)


def add_analyze_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `relational-hf analyze`."""
    parser.add_argument("model", metavar="MODEL_OR_DIR", help="a saved model folder or a model id in the local cache")
    parser.add_argument("--text", type=text_file, required=True, metavar="FILE", help="UTF-8 text to analyse")
    parser.add_argument("--out", default="analysis", metavar="DIR", help="output folder (default: analysis)")
    parser.add_argument(
        "--max-tokens", type=positive_int, default=4096, metavar="N", help="tokens of the text used (default: 4096)"
    )
    parser.add_argument("--seq-len", type=int_at_least(2), default=256, help="tokens per row (default: 256)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="rows per forward pass (default: 8)")
    parser.add_argument("--sites", nargs="+", default=list(SITES), choices=SITES, help="sites to measure and sweep")
    parser.add_argument(
        "--sweep-values",
        nargs="+",
        type=finite_float,
        default=list(DEFAULT_SWEEP),
        metavar="S",
        help="all-layer edits: scales s_par and s_perp tried at each site in every layer at once (default: 0 0.5)",
    )
    parser.add_argument(
        "--per-layer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also edit one layer at a time (default: on; --no-per-layer skips it)",
    )
    parser.add_argument(
        "--per-layer-sites",
        nargs="+",
        default=list(DEFAULT_PER_LAYER_SITES),
        choices=SITES,
        help=f"sites of the per-layer edits (default: {' '.join(DEFAULT_PER_LAYER_SITES)})",
    )
    parser.add_argument(
        "--per-layer-values",
        nargs="+",
        default=[f"{v:g}" for v in DEFAULT_PER_LAYER_PARALLEL],
        metavar="S",
        help="per-layer edits: parallel scales s_par (default: 0 0.5; none to skip)",
    )
    parser.add_argument(
        "--per-layer-perpendicular",
        nargs="+",
        default=[f"{v:g}" for v in DEFAULT_PER_LAYER_PERPENDICULAR],
        metavar="S",
        help="per-layer control: perpendicular scales s_perp (default: 0; none to skip)",
    )
    parser.add_argument(
        "--per-layer-tokens",
        type=int,
        default=512,
        metavar="N",
        help="analysed tokens (whole rows, from the first) the per-layer edits are measured on (default: 512)",
    )
    parser.add_argument(
        "--compression",
        nargs="+",
        default=list(COMPRESSION_SETTINGS),
        metavar="SETTING",
        help=f"compression settings to compare, or none to skip (default: all of {', '.join(COMPRESSION_SETTINGS)})",
    )
    parser.add_argument(
        "--calibration-fraction",
        type=fraction_closed_open,
        default=0.25,
        help="share of the rows used to calibrate Wanda (default: 0.25)",
    )
    parser.add_argument("--group-size", type=positive_int, default=128, help="quantisation group size (default: 128)")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow model code shipped with the checkpoint")
    parser.add_argument(
        "--seed", type=nonnegative_int, default=0, help="seed of the calibration/evaluation split and of sampling"
    )
    add_model_source_arguments(parser)
    return parser


def _check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag for out-of-range numbers."""
    for name in ("max_tokens", "seq_len", "batch_size", "per_layer_tokens", "group_size"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2 (a token and its target), got {args.seq_len}")
    if not 0.0 <= args.calibration_fraction < 1.0:
        raise ValueError(f"--calibration-fraction must be in [0, 1), got {args.calibration_fraction}")
    for value in args.sweep_values:
        if not math.isfinite(value):
            raise ValueError(f"--sweep-values must be finite numbers, got {value}")


def _load(args: argparse.Namespace):
    """(model, token ids of the text) for the CLI arguments."""
    from ..loading import load_model, load_tokenizer

    model = load_model(args)
    model.eval()
    text = Path(args.text).read_text(encoding="utf-8")
    try:
        tokenizer = load_tokenizer(args)
    except (OSError, ValueError, TypeError) as err:
        if model.config.vocab_size < 256:
            raise ValueError(f"{args.model} has no tokenizer ({err}) and fewer than 256 tokens for raw bytes") from err
        logger.warning("no tokenizer with %s (%s); using the UTF-8 bytes of the text as token ids", args.model, err)
        return model, torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    return model, torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def _write_atomic(path: Path, text: str) -> None:
    """Write `text` to a file beside `path`, then rename it over `path` (a reader never sees half a file)."""
    staging = path.with_name(f".{path.name}.partial")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)


def _save(out: Path, report: dict, compression: CompressionReport | None = None) -> None:
    """report.json and report.md as far as the analysis has come (`complete` says whether it finished)."""
    _write_atomic(out / "report.json", json.dumps(report, indent=2))
    _write_atomic(out / "report.md", format_markdown(report, compression) + "\n")


def run_analyze(args: argparse.Namespace) -> dict:
    """Run the analysis the flags ask for, write the JSON report, the markdown tables and the figures, print the
    tables; returns the report."""
    check_analyze_args(args)
    _check_args(args)
    settings = compression_settings(args.compression)
    per_layer_edits = [
        ("parallel", _floats_or_none("--per-layer-values", args.per_layer_values)),
        ("perpendicular", _floats_or_none("--per-layer-perpendicular", args.per_layer_perpendicular)),
    ]
    per_layer = args.per_layer and any(values for _, values in per_layer_edits)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, ids = _load(args)
    rows = token_blocks(ids, args.seq_len, args.max_tokens)
    n_cal = min(round(args.calibration_fraction * rows.shape[0]), rows.shape[0] - 1) if settings else 0
    calibration = rows[:n_cal] if n_cal > 0 else rows  # a one-row text calibrates on what it analyses
    rows = rows[n_cal:]
    batches = [rows[i : i + args.batch_size] for i in range(0, rows.shape[0], args.batch_size)]

    timings: dict[str, float] = {}
    clock = [time.perf_counter()]

    def lap(stage: str) -> None:
        now = time.perf_counter()
        timings[stage] = round(now - clock[0], 3)
        clock[0] = now

    clean = CleanPass(model, rows, None, args.batch_size, progress=True, desc="clean pass")
    lap("clean_pass")
    decomposition = decompose_dataset(model, batches, sites=args.sites, total=len(batches))
    lap("decomposition")
    sweeps = sweep_all(model, rows, args.sites, COMPONENTS, args.sweep_values, batch_size=args.batch_size, clean=clean)
    with scale_components(model, "diagonal"):
        diagonal = clean.perplexity(progress=True, desc="diagonal control")
    lap("all_layer_edits")
    figures = {"parallel_profile": str(out / "parallel_ratio.png"), "sweeps": str(out / "sweep.png")}
    plot_parallel_profile(decomposition, figures["parallel_profile"])
    plot_sweeps(sweeps, figures["sweeps"])
    report = {
        "model": args.model,
        "text": str(args.text),
        "tokens_analysed": int(rows.numel()),
        "seq_len": args.seq_len,
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
    _save(out, report)  # partial results survive an interrupted run
    if per_layer:
        n_rows = max(1, min(rows.shape[0], math.ceil(args.per_layer_tokens / args.seq_len)))
        layer_sweeps = sweep_per_layer(
            model, rows, args.per_layer_sites, per_layer_edits, batch_size=args.batch_size, clean=clean, rows=n_rows
        )
        lap("per_layer_edits")
        figures["per_layer"] = str(out / "per_layer.png")
        plot_per_layer(layer_sweeps, figures["per_layer"])
        report["per_layer"] = [s.to_dict() for s in layer_sweeps]
        _save(out, report)
    compression = None
    if settings:
        compression = compression_report(
            model,
            rows,
            settings,
            calibration_ids=calibration,
            group_size=args.group_size,
            batch_size=args.batch_size,
            clean=clean,
        )
        lap("compression")
        figures["compression"] = str(out / "compression.png")
        plot_compression(compression, figures["compression"])
        report["compression"] = compression.to_dict()
    report["complete"] = True
    _save(out, report, compression)
    print(format_table(report, compression))
    print(f"\nreport: {out / 'report.json'}, {out / 'report.md'}; figures: {', '.join(figures.values())}")
    return report


# ----------------------------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------------------------


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
