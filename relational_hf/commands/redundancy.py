"""Count a model's continuous symmetries and its invariant descriptors (DESIGN.md 2.1).

    relational-hf redundancy MODEL_OR_DIR [--png PATH] [--heatmap-dir DIR] [--json PATH] [--meta] [--no-stream]

A local safetensors folder is read one layer at a time (`redundancy_report_from_checkpoint`, the same numbers);
otherwise MODEL_OR_DIR (Hub id, folder or GGUF file; or only its config with --meta) is loaded. Prints the Markdown
report and writes the optional PNG, heatmaps and JSON.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from ..errors import UsageError
from .checks import check_model_argument, output_file, output_folder
from .options import CommandArguments, LoadDtypeOptions, ModelSourceOptions, OpenFraction, option, positional

HELP = "count a model's continuous symmetries and its invariant descriptors"


@dataclass
class RedundancyPaths:
    model: str = positional("Hub id, local checkpoint or GGUF file of a causal LM", "MODEL_OR_DIR")


@dataclass
class RedundancyOptions:
    _argument_group_name = "report"

    png: str | None = option(
        None, "write a bar chart of redundant dimensions by layer (a path as for --json)", metavar="PATH"
    )
    heatmap_dir: str | None = option(
        None, "write one head-to-head similarity heatmap (G_QK, G_VO) per layer into this folder", metavar="DIR"
    )
    json: str | None = option(
        None,
        "write the full report as JSON: a file (replaced atomically; a symbolic link's target), or - / /dev/stdout / "
        "a FIFO / a device, written through as a stream; a socket or a directory is refused before any work",
        metavar="PATH",
    )
    meta: bool = option(False, "count from the config alone (weights on the meta device; no descriptors)")
    rank_tol: OpenFraction = option(1e-3, "relative tolerance of the effective rank (singular values > tol x largest)")
    no_descriptors: bool = option(False, "skip effective ranks and similarities")
    no_stream: bool = option(
        False, "load the whole model even for a local safetensors folder (default there: read one layer at a time)"
    )


@dataclass
class RedundancyArguments(CommandArguments, LoadDtypeOptions, ModelSourceOptions, RedundancyOptions, RedundancyPaths):
    POSITIONALS = RedundancyPaths
    PARSER_GROUPS = (RedundancyOptions, ModelSourceOptions, LoadDtypeOptions)


Arguments = RedundancyArguments


def check(args: RedundancyArguments) -> None:
    """MODEL_OR_DIR exists (or is a Hub id); output paths are usable."""
    args.model = check_model_argument(args.model, "MODEL_OR_DIR", gguf_file=args.gguf_file)
    output_file(args.png, "--png")
    output_file(args.json, "--json")
    output_folder(args.heatmap_dir, "--heatmap-dir")
    if args.meta and args.heatmap_dir is not None:
        raise UsageError("--heatmap-dir needs the weights' descriptors, which --meta does not compute")


def run(args: RedundancyArguments) -> int:
    from ..loading import load_config_from, load_model_from, resolve_model_source
    from ..outputs.paths import file_target, say_wrote, write_file
    from ..shards import is_safetensors_checkpoint
    from ..symmetry.report import (
        plot_head_similarity,
        plot_redundancy_by_layer,
        redundancy_report,
        redundancy_report_from_checkpoint,
        redundancy_report_from_config,
    )

    check(args)
    source = resolve_model_source(args.model, args.gguf_file)
    if args.meta:
        config = load_config_from(source, trust_remote_code=args.trust_remote_code)
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
        model = load_model_from(source, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
        report = redundancy_report(model, descriptors=not args.no_descriptors, rank_tol=args.rank_tol)
    sys.stdout.write(report.to_markdown())
    if args.png is not None:
        plot_redundancy_by_layer(report, args.png)
        say_wrote(file_target(args.png, "--png"))
    if args.heatmap_dir is not None:
        if report.descriptors is None:
            sys.stderr.write("no descriptors computed (--meta or --no-descriptors): heatmaps skipped\n")
        else:
            paths = plot_head_similarity(report, args.heatmap_dir)
            sys.stdout.write(f"wrote {len(paths)} heatmap(s) to {args.heatmap_dir}\n")
    if args.json is not None:
        say_wrote(write_file(args.json, json.dumps(report.to_dict(), indent=2) + "\n", "--json"))
    return 0
