"""`relational-hf redundancy MODEL_OR_DIR [--png PATH] [--heatmap-dir DIR] [--json PATH] [--meta] [--no-stream]`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..loading import add_model_source_arguments, load_config, load_model
from ..validate import check_redundancy_args, fraction_open
from .report import (
    plot_head_similarity,
    plot_redundancy_by_layer,
    redundancy_report,
    redundancy_report_from_checkpoint,
    redundancy_report_from_config,
)


def add_redundancy_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `redundancy` command's arguments to `parser`."""
    parser.add_argument("model", metavar="MODEL_OR_DIR", help="Hub id or local checkpoint of a causal LM")
    parser.add_argument("--png", type=Path, default=None, help="write a bar chart of redundant dimensions by layer")
    parser.add_argument(
        "--heatmap-dir",
        type=Path,
        default=None,
        help="write one head-to-head similarity heatmap (G_QK, G_VO) per layer into this folder",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the full report as JSON")
    parser.add_argument(
        "--meta", action="store_true", help="count from the config alone (weights on the meta device; no descriptors)"
    )
    parser.add_argument(
        "--rank-tol",
        type=fraction_open,
        default=1e-3,
        help="relative tolerance of the effective rank (singular values > tol x largest)",
    )
    parser.add_argument("--no-descriptors", action="store_true", help="skip effective ranks and similarities")
    parser.add_argument(
        "--no-stream",
        action="store_true",
        help="load the whole model even for a local safetensors folder (default there: read one layer at a time)",
    )
    parser.add_argument("--trust-remote-code", action="store_true", help="passed to from_pretrained")
    add_model_source_arguments(parser)
    return parser


def run_redundancy(args: argparse.Namespace) -> int:
    """(Importing this package registers the relational architecture with the Auto classes.)
    A local safetensors folder is read one layer at a time (`redundancy_report_from_checkpoint`, same numbers);
    otherwise load MODEL_OR_DIR (Hub id, folder or GGUF file; or only its config with --meta). Print the Markdown
    report to stdout, and write the optional PNG / heatmaps / JSON. Returns the process exit code."""
    from ..shards import is_safetensors_checkpoint

    check_redundancy_args(args)
    if args.meta:
        config = load_config(args)
        report = redundancy_report_from_config(config, trust_remote_code=args.trust_remote_code)
    elif is_safetensors_checkpoint(args.model) and not args.no_stream and args.gguf_file is None:
        report = redundancy_report_from_checkpoint(
            args.model,
            descriptors=not args.no_descriptors,
            rank_tol=args.rank_tol,
            trust_remote_code=args.trust_remote_code,
            progress=True,
        )
    else:
        model = load_model(args)
        want = not args.no_descriptors
        report = redundancy_report(model, descriptors=want, rank_tol=args.rank_tol)
    sys.stdout.write(report.to_markdown())
    if args.png is not None:
        sys.stdout.write(f"wrote {plot_redundancy_by_layer(report, args.png)}\n")
    if args.heatmap_dir is not None:
        if report.descriptors is None:
            sys.stderr.write("no descriptors computed (--meta or --no-descriptors): heatmaps skipped\n")
        else:
            paths = plot_head_similarity(report, args.heatmap_dir)
            sys.stdout.write(f"wrote {len(paths)} heatmap(s) to {args.heatmap_dir}\n")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_dict(), indent=2))
        sys.stdout.write(f"wrote {args.json}\n")
    return 0


__all__ = ["add_redundancy_arguments", "run_redundancy"]
