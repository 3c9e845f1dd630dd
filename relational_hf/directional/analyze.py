"""`relational-hf analyze MODEL_OR_DIR --text FILE`: the directional analysis of a causal LM on a text file.

Writes `report.json` and three PNG figures to --out (per-layer parallel ratio by site, the Delta PPL sweeps,
the compression errors) and prints a short table. The text is cut into rows of --seq-len tokens (at most
--max-tokens); the first --calibration-fraction of the rows calibrate Wanda, the rest are analysed.
"""

from __future__ import annotations

import argparse
import json
import logging
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
from .evaluation import COMPONENTS, perplexity, sweep_all
from .plots import plot_compression, plot_parallel_profile, plot_sweeps
from .sites import SITES

logger = logging.getLogger(__name__)

DEFAULT_SWEEP = (0.0, 0.5, 1.5)


def add_analyze_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `relational-hf analyze`."""
    parser.add_argument("model", metavar="MODEL_OR_DIR", help="a saved model folder or a model id in the local cache")
    parser.add_argument("--text", type=text_file, required=True, metavar="FILE", help="UTF-8 text to analyse")
    parser.add_argument("--out", default="analysis", metavar="DIR", help="output folder (default: analysis)")
    parser.add_argument("--max-tokens", type=positive_int, default=16384, metavar="N", help="tokens of the text used")
    parser.add_argument("--seq-len", type=int_at_least(2), default=256, help="tokens per row (default: 256)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="rows per forward pass")
    parser.add_argument("--sites", nargs="+", default=list(SITES), choices=SITES, help="sites to measure and sweep")
    parser.add_argument(
        "--sweep-values",
        nargs="+",
        type=finite_float,
        default=list(DEFAULT_SWEEP),
        metavar="S",
        help="scales s_par and s_perp tried at each site (default: 0 0.5 1.5)",
    )
    parser.add_argument(
        "--compression",
        nargs="*",
        default=list(COMPRESSION_SETTINGS),
        metavar="SETTING",
        help=f"compression settings to compare, none to skip (default: all of {', '.join(COMPRESSION_SETTINGS)})",
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


def run_analyze(args: argparse.Namespace) -> dict:
    """Run the analysis the flags ask for, write the JSON report and the figures, print a table; returns the report."""
    check_analyze_args(args)
    torch.manual_seed(args.seed)
    settings = settings_from(args.compression)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, ids = _load(args)
    rows = token_blocks(ids, args.seq_len, args.max_tokens)
    n_cal = min(round(args.calibration_fraction * rows.shape[0]), rows.shape[0] - 1) if settings else 0
    calibration = rows[:n_cal] if n_cal > 0 else rows  # a one-row text calibrates on what it analyses
    rows = rows[n_cal:]
    batches = [rows[i : i + args.batch_size] for i in range(0, rows.shape[0], args.batch_size)]

    decomposition = decompose_dataset(model, batches, sites=args.sites, total=len(batches))
    sweeps = sweep_all(model, rows, args.sites, COMPONENTS, args.sweep_values, batch_size=args.batch_size)
    baseline = sweeps[0].baseline
    with scale_components(model, "diagonal"):
        diagonal = perplexity(model, rows, batch_size=args.batch_size)
    figures = {"parallel_profile": str(out / "parallel_ratio.png"), "sweeps": str(out / "sweep.png")}
    plot_parallel_profile(decomposition, figures["parallel_profile"])
    plot_sweeps(sweeps, figures["sweeps"])
    report = {
        "model": args.model,
        "text": str(args.text),
        "tokens_analysed": int(rows.numel()),
        "seq_len": args.seq_len,
        "perplexity": baseline,
        "decomposition": decomposition.to_dict(),
        "sweeps": [s.to_dict() for s in sweeps],
        "diagonal_removal": {"perplexity": diagonal, "delta": diagonal - baseline},
        "figures": figures,
    }
    compression = None
    if settings:
        compression = compression_report(
            model, rows, settings, calibration_ids=calibration, group_size=args.group_size, batch_size=args.batch_size
        )
        figures["compression"] = str(out / "compression.png")
        plot_compression(compression, figures["compression"])
        report["compression"] = compression.to_dict()
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(format_table(report, compression))
    print(f"\nreport: {out / 'report.json'}; figures: {', '.join(figures.values())}")
    return report


def format_table(report: dict, compression: CompressionReport | None = None) -> str:
    """A short text summary: per site the mean and last-layer |y_par|/|y_perp| and Delta PPL at the smallest swept
    scale of each component; the diagonal control; the compression ranking when there is one."""
    sweeps = {(s["site"], s["component"]): s for s in report["sweeps"]}
    s_min = min(report["sweeps"][0]["values"])
    header = f"{'site':<20}{'mean ratio':>12}{'last layer':>12}" + "".join(
        f"{f'dPPL s_{c[:4]}={s_min:g}':>18}" for c in COMPONENTS
    )
    lines = [f"perplexity {report['perplexity']:.3f} on {report['tokens_analysed']} tokens", "", header]
    for site, layers in report["decomposition"].items():
        ratios = [layer["parallel_ratio"] for layer in layers]
        deltas = [sweeps[(site, c)]["deltas"][sweeps[(site, c)]["values"].index(s_min)] for c in COMPONENTS]
        lines.append(
            f"{site:<20}{sum(ratios) / len(ratios):>12.4f}{ratios[-1]:>12.4f}" + "".join(f"{d:>+18.3f}" for d in deltas)
        )
    lines.append(f"diagonal removal (A_tt = 0): dPPL {report['diagonal_removal']['delta']:+.3f}")
    if compression is not None:
        lines += ["", compression.to_markdown()]
    return "\n".join(lines)
